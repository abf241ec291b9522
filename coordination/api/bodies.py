"""Request bodies validated without building a serializer per request.

A DRF serializer deep-copies its declared fields every time one is built, and a hot endpoint
builds one per request. For a flat request serializer (no nested serializer but a list of
flat ones, ``many=True``; no ``validate`` / ``validate_<field>`` or other checks of its own)
the same checks can run on fields built once: ``plain_body(SerializerClass, data)`` runs each
field's own ``run_validation`` on a copy of the fields made at first use (and each item of a
list through its serializer's fields), and returns the validated data exactly as
``serializer.validated_data`` would. When anything is off (an unknown or missing field, a
value a field refuses, a serializer it cannot handle) it returns None, and the caller builds
the serializer, which answers with its exact error. The OpenAPI schema still comes from the
serializer classes (``tests/coordination/test_plain_bodies.py`` shows the two agree).
"""

from collections.abc import Mapping
from typing import Any

from rest_framework import serializers
from rest_framework.fields import SkipField

from coordination.api.serializers import StrictSerializer
from coordination.services.tasks import TaskSpec

# What a serializer class may define to check more than its fields do; StrictSerializer's
# own to_internal_value (unknown fields are refused) is what plain_body does itself.
_OWN_VALIDATION = {"validate", "to_internal_value", "run_validation", "run_validators", "is_valid"}
_UNSUPPORTED = object()
_fields_by_class: dict[type, Any] = {}


def _fields(serializer_class: type[serializers.Serializer]) -> Any:
    """Return the bound fields of ``serializer_class`` if it is flat, else ``_UNSUPPORTED``; built once per class."""
    found = _fields_by_class.get(serializer_class)
    if found is None:
        own_validation = any(
            name in _OWN_VALIDATION or name.startswith("validate_")
            for klass in serializer_class.__mro__
            if not klass.__module__.startswith("rest_framework.") and klass is not StrictSerializer
            for name in vars(klass)
        )
        prototype = serializer_class()
        fields = prototype.fields
        nested = any(
            isinstance(field, serializers.BaseSerializer) and not _plain_list(field) for field in fields.values()
        )
        found = _UNSUPPORTED if own_validation or nested else dict(fields)
        _fields_by_class[serializer_class] = found
    return found


def _plain_list(field) -> bool:
    """Tell whether ``field`` is a list of a flat serializer (``many=True``) with no checks of its own."""
    return (
        type(field) is serializers.ListSerializer
        and not field.validators
        and isinstance(field.child, serializers.Serializer)
        and _fields(type(field.child)) is not _UNSUPPORTED
    )


def _list_value(field: serializers.ListSerializer, data: object) -> list:
    """Validate a list of a flat serializer's bodies as ``ListSerializer.run_validation``; refuse anything else."""
    if not isinstance(data, list) or (not data and not field.allow_empty):
        raise serializers.ValidationError("left to the serializer")
    if (field.min_length is not None and len(data) < field.min_length) or (
        field.max_length is not None and len(data) > field.max_length
    ):
        raise serializers.ValidationError("left to the serializer")
    items = []
    for item in data:
        validated = plain_body(type(field.child), item)
        if validated is None:
            raise serializers.ValidationError("left to the serializer")
        items.append(validated)
    return items


def plain_body(serializer_class: type[serializers.Serializer], data: object) -> dict | None:
    """Return ``data`` validated by ``serializer_class``'s fields, or None to let the serializer decide."""
    fields = _fields(serializer_class)
    if fields is _UNSUPPORTED or not isinstance(data, Mapping) or not data.keys() <= fields.keys():
        return None
    validated = {}
    try:
        for name, field in fields.items():
            if field.read_only:
                continue
            if name in data:
                if isinstance(field, serializers.ListSerializer):
                    validated[name] = _list_value(field, data[name])
                else:
                    validated[name] = field.run_validation(data[name])
            elif field.required:
                return None
            else:
                try:
                    validated[name] = field.get_default()
                except SkipField:
                    pass
    except serializers.ValidationError:
        return None
    return validated


def task_spec(item: Mapping[str, Any]) -> TaskSpec:
    """Return the ``TaskSpec`` of a validated task body (``TaskSubmitIn``, or one item of a batch)."""
    return TaskSpec(
        input=item["input"],
        key=item["key"],
        priority=item["priority"],
        max_attempts=item.get("maxAttempts"),
        expires_at=item["expiresAt"],
    )
