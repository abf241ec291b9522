"""System checks of runstate's own deployment settings (``manage.py check --deploy``)."""

import os

from django.conf import settings
from django.core.checks import Tags, Warning, register


@register(Tags.security, deploy=True)
def secret_key_from_the_environment(app_configs, **kwargs):
    """Warn when ``SECRET_KEY`` is not set: the key generated into ``RUNSTATE_VAR_DIR`` is that machine's alone."""
    if os.environ.get("SECRET_KEY"):
        return []
    return [
        Warning(
            "SECRET_KEY is not set: this process signs with the key generated in "
            f"{settings.SECRET_KEY_FILE}, which no other machine has.",
            hint="Set SECRET_KEY to the same 50+ random characters on every machine (docs/deploy.md).",
            id="runstate.W001",
        )
    ]
