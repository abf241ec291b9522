"""App configuration for the coordination domain."""

from django.apps import AppConfig


class CoordinationConfig(AppConfig):
    """Register the coordination app."""

    name = "coordination"
    verbose_name = "Coordination"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the OpenAPI description of the API-key authentication; keep keys out of every log."""
        from coordination.api import schema  # noqa: F401 - registers the extension
        from coordination.logging import redact_every_handler

        # Logging is configured by now (uvicorn's before it imported the app, Django's at setup).
        redact_every_handler()
