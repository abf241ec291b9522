"""OpenAPI extensions: how drf-spectacular describes runstate's authentication and common errors."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Describe ``ApiKeyAuthentication`` as an HTTP bearer scheme."""

    target_class = "coordination.api.auth.ApiKeyAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        """Return the security scheme object."""
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key: `Authorization: Bearer rs_<prefix>_<secret>`.",
        }


class MetricsTokenAuthenticationScheme(OpenApiAuthenticationExtension):
    """Describe ``MetricsTokenAuthentication`` (``RUNSTATE_METRICS_TOKEN``) as an HTTP bearer scheme."""

    target_class = "coordination.api.auth.MetricsTokenAuthentication"
    name = "metricsToken"

    def get_security_definition(self, auto_schema):
        """Return the security scheme object."""
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "The server's `RUNSTATE_METRICS_TOKEN` (for Prometheus): "
            "`Authorization: Bearer <token>`, on `/v1/metrics` only.",
        }


def _error(description: str, *, retry_after: bool = False) -> dict:
    response = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}},
    }
    if retry_after:
        response["headers"] = {
            "Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait before retrying."}
        }
    return response


# Answers that come from the transport around an operation rather than from its logic
# (``with_errors`` in the views documents those): any keyed operation may give them.
KEYED_ERRORS = {
    "406": _error("NOT_ACCEPTABLE: the Accept header excludes application/json"),
    "429": _error(
        "RATE_LIMITED: the key's requests for this window are spent (with Retry-After), or, for a "
        "long-poll or the event stream, the key holds RUNSTATE_MAX_WAITS_PER_KEY waits in this process",
        retry_after=True,
    ),
    "503": _error("SERVICE_UNAVAILABLE: the database is unavailable", retry_after=True),
}
# Any operation that reads a JSON body may give these.
BODY_ERRORS = {
    "413": _error("VALIDATION_ERROR: the request body is too large"),
    "415": _error("UNSUPPORTED_MEDIA_TYPE: the request body is not JSON"),
}


def add_transport_errors(result, generator, request, public):
    """Document the error answers every keyed operation (and every body) can get, in one place."""
    for item in result.get("paths", {}).values():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            # An operation answering another type than JSON (the event stream) negotiates
            # nothing: it never answers 406 (``coordination.api.negotiation``).
            negotiates = not any(
                answer.get("content") and "application/json" not in answer["content"]
                for status, answer in responses.items()
                if status.startswith("2")
            )
            if any("bearerAuth" in requirement for requirement in operation.get("security", [])):
                for status, response in KEYED_ERRORS.items():
                    if status != "406" or negotiates:
                        responses.setdefault(status, response)
            if "requestBody" in operation:
                for status, response in BODY_ERRORS.items():
                    responses.setdefault(status, response)
    return result
