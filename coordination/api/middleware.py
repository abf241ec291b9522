"""Middleware of the API's own stack (``settings.API_MIDDLEWARE``)."""

from django.middleware.csp import ContentSecurityPolicyMiddleware
from django.middleware.security import SecurityMiddleware


class ApiSecurityMiddleware(SecurityMiddleware):
    """Django's ``SecurityMiddleware`` (HTTPS redirect, security headers) without its thread hops.

    Under ASGI Django runs a synchronous middleware's ``process_request`` and
    ``process_response`` in a worker thread each: two hops per request for what is a few
    header assignments. Neither touches the database or blocks, so here both run inline on
    the event loop.
    """

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
