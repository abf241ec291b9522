"""App configuration for the coordination domain."""

from django.apps import AppConfig


class CoordinationConfig(AppConfig):
    """Register the coordination app."""

    name = "coordination"
    verbose_name = "Coordination"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the OpenAPI description of the API-key authentication; keep keys out of every log.

        Also: a process that saves or deletes an API key or a mailbox forgets its cached copy
        at once (``coordination.plumbing.process_cache``), and runstate's deployment checks are
        registered (``coordination.plumbing.checks``), and so is every step of the subtree cascade
        (``coordination.services.cascade``).
        """
        from django.db.models.signals import post_delete, post_save

        from coordination.api import schema  # noqa: F401 - registers the extension
        from coordination.models import ApiKey, Mailbox
        from coordination.plumbing import checks, process_cache  # noqa: F401 - checks registers the system checks
        from coordination.plumbing.logging import redact_every_handler

        for model in (ApiKey, Mailbox):
            post_save.connect(
                process_cache.forget_row, sender=model, dispatch_uid=f"process_cache.{model.__name__}.save"
            )
            post_delete.connect(
                process_cache.forget_row, sender=model, dispatch_uid=f"process_cache.{model.__name__}.delete"
            )

        # The aggregates register their cascade steps as they load (services.cascade imports
        # none of them); load them all now, so that a step missing is a start-up error.
        from coordination.services import (  # noqa: F401 - each aggregate registers its steps
            admissions,
            barriers,
            cascade,
            groups,
            messages,
            pools,
            tasks,
            timers,
        )

        cascade.cascade_steps()

        # Logging is configured by now (uvicorn's before it imported the app, Django's at setup).
        redact_every_handler()
