"""ASGI entry point: uvicorn (``scripts/start``, production) and ``manage.py runserver`` (daphne) serve it.

Requests under ``/v1/`` go through a middleware stack of their own (``API_MIDDLEWARE``: request
id and logging, security headers): the API authenticates with keys, so sessions, CSRF, the
admin's user and messages stay on the admin's stack (``MIDDLEWARE``). Under ASGI each
synchronous middleware costs a thread hop per request, so the API's stack is kept short.
"""

import os

from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runstate_project.settings")

API_PREFIX = "/v1/"


class ApiASGIHandler(ASGIHandler):
    """Django's ASGI handler, with ``API_MIDDLEWARE`` in place of ``MIDDLEWARE``."""

    def load_middleware(self, is_async=False):  # noqa: D102
        # BaseHandler reads settings.MIDDLEWARE while it builds the chain, once, at start-up.
        full = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = full


def _route(api, site):
    """Send ``/v1/`` requests to ``api`` and everything else (admin, static, lifespan) to ``site``."""

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIX):
            return await api(scope, receive, send)
        return await site(scope, receive, send)

    return app


site = get_asgi_application()  # sets Django up
if settings.RUNSTATE_SERVE_STATIC:
    site = ASGIStaticFilesHandler(site)
application = _route(ApiASGIHandler(), site)
