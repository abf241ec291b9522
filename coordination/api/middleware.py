"""Middleware of the API's own stack (``settings.API_MIDDLEWARE``)."""

import logging

from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import JsonResponse
from django.http.response import ResponseHeaders
from django.middleware.csp import ContentSecurityPolicyMiddleware, get_nonce
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

    The headers every answer gets (``X-Content-Type-Options``, ``Referrer-Policy``,
    ``Cross-Origin-Opener-Policy``: set once, from settings read once, as Django's middleware
    reads them) are checked and encoded once at start-up and added to each answer that does
    not set them itself; ``Strict-Transport-Security`` stays Django's (it depends on the request).
    """

    def __init__(self, get_response) -> None:
        super().__init__(get_response)
        self.constant_headers = _checked(
            ("X-Content-Type-Options", "nosniff" if self.content_type_nosniff else None),
            ("Referrer-Policy", _referrer_policy(self.referrer_policy)),
            ("Cross-Origin-Opener-Policy", self.cross_origin_opener_policy),
        )

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

    def process_response(self, request, response):  # noqa: D102 - see the class
        if self.sts_seconds and request.is_secure() and "Strict-Transport-Security" not in response:
            return super().process_response(request, response)  # rare (HTTPS with HSTS): Django's, whole
        _add_missing(response, self.constant_headers)
        return response

    async def __acall__(self, request):  # noqa: D102 - see the class
        response = self.process_request(request) or await self.get_response(request)
        return self.process_response(request, response)


class ApiContentSecurityPolicyMiddleware(ContentSecurityPolicyMiddleware):
    """Django's ``ContentSecurityPolicyMiddleware`` (``SECURE_CSP``) without its thread hops, as above.

    The API answers JSON, but ``/v1/docs`` is a page (Swagger UI) that needs the policy.

    An answer whose nonce was not used and that sets no policy of its own (every JSON answer)
    gets the policy built once from ``SECURE_CSP`` / ``SECURE_CSP_REPORT_ONLY`` (built again
    when those settings are other objects, as under ``override_settings``) instead of built per
    answer; any other answer gets Django's.
    """

    def __init__(self, get_response) -> None:
        super().__init__(get_response)
        self._built: tuple = (None, None, ())  # (SECURE_CSP, SECURE_CSP_REPORT_ONLY, their headers)

    def process_response(self, request, response):  # noqa: D102 - see the class
        if get_nonce(request) or hasattr(response, "_csp_config") or hasattr(response, "_csp_ro_config"):
            return super().process_response(request, response)
        enforced, report_only = settings.SECURE_CSP, settings.SECURE_CSP_REPORT_ONLY
        if self._built[0] is not enforced or self._built[1] is not report_only:
            # What Django's process_response computes for an answer without a nonce or a policy of its own.
            built = super().process_response(request, _HeadersOnly())
            self._built = (enforced, report_only, _checked(*built.headers.items()))
        _add_missing(response, self._built[2])
        return response

    async def __acall__(self, request):  # noqa: D102 - see the class
        self.process_request(request)
        return self.process_response(request, await self.get_response(request))


class _HeadersOnly:
    """A response with no headers, to learn the headers a middleware adds (``headers``, ``in``)."""

    def __init__(self) -> None:
        self.headers = ResponseHeaders({})

    def __contains__(self, header: str) -> bool:
        return header in self.headers


def _referrer_policy(policy) -> str | None:
    """Return the ``Referrer-Policy`` value as Django's ``SecurityMiddleware`` writes it."""
    if not policy:
        return None
    return ",".join([value.strip() for value in policy.split(",")] if isinstance(policy, str) else policy)


def _checked(*headers) -> tuple:
    """Return ``(name, value)`` pairs as ``ResponseHeaders`` stores them, checked (charset, newlines) once."""
    stored = ResponseHeaders({})
    for name, value in headers:
        if value:
            stored[name] = value
    return tuple(stored._store.items())


def _add_missing(response, headers: tuple) -> None:
    """Add each of ``headers`` (``_checked``'s) the response does not set, as ``setdefault`` would."""
    store = response.headers._store
    for lowered, pair in headers:
        if lowered not in store:
            store[lowered] = pair
