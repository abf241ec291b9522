"""App configuration for the Celery integration."""

from django.apps import AppConfig


class WorkersConfig(AppConfig):
    """Register the workers app."""

    name = "workers"
    verbose_name = "Workers"
