"""App configuration for the coordination domain."""

from django.apps import AppConfig


class CoordinationConfig(AppConfig):
    """Register the coordination app."""

    name = "coordination"
    verbose_name = "Coordination"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the OpenAPI description of the API-key authentication."""
        from coordination.api import schema  # noqa: F401 - registers the extension
