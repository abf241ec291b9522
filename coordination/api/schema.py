"""OpenAPI extensions: how drf-spectacular describes runstate's authentication, payloads and common errors."""

import copy

from drf_spectacular.extensions import (
    OpenApiAuthenticationExtension,
    OpenApiSerializerExtension,
    OpenApiSerializerFieldExtension,
)
from rest_framework import serializers

from coordination.services.mailboxes import NAME_PATTERN

# A string DRF's CharField accepts: no NUL character (``ProhibitNullCharactersValidator``) and,
# unless blank is allowed, something left once str.strip() has trimmed it (whitespace as Python
# counts it: ECMA's \s lacks U+001C-U+001F and U+0085). Without lookarounds, for every regex engine.
# Where blank is allowed drf-spectacular adds a ``oneOf`` branch for "" beside the pattern's: the
# pattern then refuses "", or "" would match both branches (and ``oneOf`` none).
NO_NUL = "^[^\\u0000]*$"
NO_NUL_NOT_EMPTY = "^[^\\u0000]+$"
NOT_BLANK = "^[^\\u0000]*[^\\s\\u0000\\u001c-\\u001f\\u0085][^\\u0000]*$"

# Any JSON value but null, in OpenAPI 3.0.3: an empty schema admits null too (``nullable``
# only restricts a schema that names a ``type``), so the types are listed.
JSON_NOT_NULL = {
    "anyOf": [
        {"type": "object", "additionalProperties": {}},
        {"type": "array", "items": {}},
        {"type": "string", "pattern": NO_NUL},
        {"type": "number"},
        {"type": "boolean"},
    ]
}


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


class CharFieldSchema(OpenApiSerializerFieldExtension):
    """Describe a request's ``CharField`` with the refusals drf-spectacular leaves out.

    DRF refuses a string holding NUL, and a whitespace-only string where blank is not allowed
    (it trims before the blank check): ``pattern`` says so. Answers are described as they are.
    """

    target_class = "rest_framework.serializers.CharField"
    match_subclasses = True

    def map_serializer_field(self, auto_schema, direction):
        """Return drf-spectacular's schema of the field, with the pattern of what it accepts in a request."""
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        if direction == "request":
            blank_ok = self.target.allow_blank or not self.target.trim_whitespace
            schema["pattern"] = getattr(self.target, "schema_pattern", NO_NUL_NOT_EMPTY if blank_ok else NOT_BLANK)
        return schema


class PayloadFieldSchema(OpenApiSerializerFieldExtension):
    """Describe a ``PayloadField`` as what it accepts: any JSON value, null only where it allows null."""

    target_class = "coordination.api.serializers.PayloadField"

    def map_serializer_field(self, auto_schema, direction):
        """Return ``{}`` (any value, null included) for a field that allows null, else ``JSON_NOT_NULL``."""
        return {} if self.target.allow_null else dict(JSON_NOT_NULL)


class StrictSerializerSchema(OpenApiSerializerExtension):
    """Describe a request body (a ``StrictSerializer``) as what it accepts.

    drf-spectacular leaves three of its refusals out: a field it does not know
    (``additionalProperties: false``), a list of items shorter or longer than its bounds
    (``min_length``/``max_length`` of a ``many=True`` field: ``minItems``/``maxItems``), and a
    required field of a ``PATCH`` body (it marks a PATCH body partial, as DRF would, but the
    views validate the whole body: a missing field is a 400). A serializer's ``schema_constraints``
    add what its view or service checks beyond the fields (``TimerCreateIn``).
    """

    target_class = "coordination.api.serializers.StrictSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        """Return drf-spectacular's schema of the body, with the refusals it leaves out."""
        serializer = self.target
        if serializer.partial:
            serializer = copy.copy(serializer)
            serializer.partial = False
        schema = auto_schema._map_serializer(serializer, direction, bypass_extensions=True)
        schema["additionalProperties"] = False
        properties = schema.get("properties", {})
        # What the view or service checks beyond the fields, where a schema can say it.
        constraints = getattr(serializer, "schema_constraints", {})
        for name, extra in constraints.get("properties", {}).items():
            properties[name].update(extra)
        schema.update({key: copy.deepcopy(value) for key, value in constraints.items() if key != "properties"})
        for name, field in serializer.fields.items():
            if isinstance(field, serializers.ListSerializer) and name in properties:
                if field.min_length is not None:
                    properties[name]["minItems"] = field.min_length
                if field.max_length is not None:
                    properties[name]["maxItems"] = field.max_length
        return schema


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


# The path parameter ``{name}`` of these paths names a mailbox, a pool or a quota: a name that
# does not match is a 400 (``VALIDATION_ERROR``) where it would be created, a 404 elsewhere.
NAMED_PATH_PREFIXES = ("/v1/mailboxes/", "/v1/pools/", "/v1/quotas/")


def constrain_name_parameters(result, generator, request, public):
    """Give the ``{name}`` of a mailbox, pool or quota path the pattern its services check."""
    for path, item in result.get("paths", {}).items():
        if not path.startswith(NAMED_PATH_PREFIXES):
            continue
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "path" and parameter["name"] == "name":
                    parameter["schema"] = {"type": "string", "pattern": NAME_PATTERN.pattern, "maxLength": 100}
    return result
