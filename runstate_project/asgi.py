"""ASGI entry point: uvicorn (``scripts/start``, production) and ``manage.py runserver`` (daphne) serve it."""

import os

from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

application = get_asgi_application()
if settings.RUNSTATE_SERVE_STATIC:
    application = ASGIStaticFilesHandler(application)
