"""The API's security and CSP middleware add exactly the headers Django's own middleware adds.

``ApiSecurityMiddleware`` and ``ApiContentSecurityPolicyMiddleware`` (coordination/api/middleware.py)
add headers checked once at start-up instead of building them per answer. Each case runs the same
request and answer through Django's ``SecurityMiddleware`` and ``ContentSecurityPolicyMiddleware``
and through the API's pair, in the order of ``API_MIDDLEWARE``, and compares the headers (names,
values and order): a plain answer, answers that set their own headers, a view that uses the
nonce, a view with its own policy, HTTPS with HSTS, and settings changed between answers.
"""

import pytest
from django.http import JsonResponse
from django.middleware.csp import ContentSecurityPolicyMiddleware
from django.middleware.security import SecurityMiddleware
from django.test import RequestFactory, override_settings
from django.utils.csp import CSP

from coordination.api.middleware import ApiContentSecurityPolicyMiddleware, ApiSecurityMiddleware


def answer(request):
    return JsonResponse({"ok": True})


def own_headers(request):
    response = JsonResponse({"ok": True})
    response["Referrer-Policy"] = "no-referrer"
    response["X-Content-Type-Options"] = "other"
    response["Content-Security-Policy"] = "default-src 'none'"
    return response


def uses_nonce(request):
    return JsonResponse({"nonce": str(request._csp_nonce)})


def own_policy(request):
    response = JsonResponse({"ok": True})
    response._csp_config = {"default-src": [CSP.NONE]}
    response._csp_ro_config = {"img-src": [CSP.SELF]}
    return response


def headers_of(security, csp, view, **request_options) -> list[tuple[str, str]]:
    request = RequestFactory().get("/v1/runs", **request_options)
    response = security(csp(view))(request)
    return list(response.items())


def both(view, **request_options):
    django = headers_of(SecurityMiddleware, ContentSecurityPolicyMiddleware, view, **request_options)
    api = headers_of(ApiSecurityMiddleware, ApiContentSecurityPolicyMiddleware, view, **request_options)
    return django, api


@pytest.mark.parametrize("view", [answer, own_headers, own_policy], ids=["plain", "own headers", "own policy"])
def test_the_api_adds_the_headers_django_adds(view):
    django, api = both(view)
    assert api == django
    assert ("X-Content-Type-Options", "other" if view is own_headers else "nosniff") in api


def test_a_view_that_uses_the_nonce_gets_it_in_the_policy():
    with override_settings(SECURE_CSP={"default-src": [CSP.SELF], "script-src": [CSP.SELF, CSP.NONCE]}):
        api = dict(headers_of(ApiSecurityMiddleware, ApiContentSecurityPolicyMiddleware, uses_nonce))
        plain = dict(headers_of(ApiSecurityMiddleware, ApiContentSecurityPolicyMiddleware, answer))
    assert "'nonce-" in api["Content-Security-Policy"]
    assert plain["Content-Security-Policy"] == "default-src 'self'; script-src 'self'"


@override_settings(SECURE_HSTS_SECONDS=3600, SECURE_HSTS_INCLUDE_SUBDOMAINS=True, SECURE_SSL_REDIRECT=False)
def test_https_with_hsts_gets_django_s_transport_security_header():
    django, api = both(answer, secure=True)
    assert api == django
    assert ("Strict-Transport-Security", "max-age=3600; includeSubDomains") in api
    assert both(answer)[1] == both(answer)[0]  # plain HTTP: no such header


def test_the_policy_follows_the_settings_from_one_answer_to_the_next():
    security = ApiSecurityMiddleware(ApiContentSecurityPolicyMiddleware(answer))
    request = RequestFactory().get("/v1/runs")
    first = security(request)["Content-Security-Policy"]
    with override_settings(SECURE_CSP={"default-src": [CSP.NONE]}, SECURE_CSP_REPORT_ONLY={"img-src": ["data:"]}):
        changed = security(RequestFactory().get("/v1/runs"))
    again = security(RequestFactory().get("/v1/runs"))["Content-Security-Policy"]
    assert changed["Content-Security-Policy"] == "default-src 'none'"
    assert changed["Content-Security-Policy-Report-Only"] == "img-src data:"
    assert first == again != "default-src 'none'"


@override_settings(SECURE_REFERRER_POLICY=["same-origin", "strict-origin"], SECURE_CROSS_ORIGIN_OPENER_POLICY=None)
def test_settings_read_at_start_up_are_django_s_too():
    django, api = both(answer)
    assert api == django
    assert ("Referrer-Policy", "same-origin,strict-origin") in api
