"""Middleware of the API's own stack (``settings.API_MIDDLEWARE``)."""

import logging

from django.core.exceptions import DisallowedHost
from django.http import JsonResponse
from django.middleware.csp import ContentSecurityPolicyMiddleware
from django.middleware.security import SecurityMiddleware

from coordination.api.errors import envelope

# Django's own logger for the same refusal on the admin's stack, so one logging rule covers both.
disallowed_host_logger = logging.getLogger("django.security.DisallowedHost")


class ApiSecurityMiddleware(SecurityMiddleware):
    """Django's ``SecurityMiddleware`` (HTTPS redirect, security headers) and ``ALLOWED_HOSTS``, without thread hops.

    On the admin's stack ``CommonMiddleware`` calls ``request.get_host()``, which refuses a
    ``Host`` that is not in ``ALLOWED_HOSTS``; nothing on the API's short stack did, so a page
    that rebinds its DNS name to the service was answered. Here every ``/v1`` request, async
    views included, is checked first and a wrong host answers 400 with the error envelope (as
    JSON even under ``DEBUG``, where Django would render its debug page).

    Under ASGI Django runs a synchronous middleware's ``process_request`` and
    ``process_response`` in a worker thread each: two hops per request for what is a few
    header assignments. None of it touches the database or blocks, so here both run inline on
    the event loop.
    """

    def process_request(self, request):  # noqa: D102 - see the class
        try:
            request.get_host()
        except DisallowedHost as refusal:
            disallowed_host_logger.warning("%s", refusal, extra={"status_code": 400})
            return JsonResponse(
                envelope(
                    "VALIDATION_ERROR", "The Host header is not one this service answers to.", {"host": "not allowed"}
                ),
                status=400,
            )
        return super().process_request(request)

    async def __acall__(self, request):  # noqa: D102 - see the class
        response = self.process_request(request) or await self.get_response(request)
        return self.process_response(request, response)


class ApiContentSecurityPolicyMiddleware(ContentSecurityPolicyMiddleware):
    """Django's ``ContentSecurityPolicyMiddleware`` (``SECURE_CSP``) without its thread hops, as above.

    The API answers JSON, but ``/v1/docs`` is a page (Swagger UI) that needs the policy.
    """

    async def __acall__(self, request):  # noqa: D102 - see the class
        self.process_request(request)
        return self.process_response(request, await self.get_response(request))
