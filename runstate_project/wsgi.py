"""WSGI entry point, for tooling that expects one; the service itself runs under ASGI."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

application = get_wsgi_application()
