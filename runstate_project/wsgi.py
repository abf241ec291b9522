"""WSGI entry point, for tooling that expects one; the service itself runs under ASGI."""

import os

from django.core.wsgi import get_wsgi_application

from runstate_project.tracing import setup_tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

setup_tracing("api")
application = get_wsgi_application()
