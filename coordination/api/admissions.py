"""Request bodies, response shapes and presenters of admissions (``/v1/runs/{id}/admission(s)``, ``/v1/admissions``)."""

from rest_framework import serializers

from coordination.api.presenters import iso, present_run
from coordination.api.serializers import (
    MAX_KEY_LENGTH,
    MAX_NAME_LENGTH,
    RunOut,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
)
from coordination.domain.states import AdmissionState
from coordination.models import Admission, AdmissionConfig
from coordination.reads import selectors
from coordination.services.admissions import MAX_ACTIVE, admission_position


class AdmissionConfigIn(StrictSerializer):
    """Body of ``PUT /v1/runs/{id}/admission``."""

    maxActive = StrictIntegerField(min_value=0, max_value=MAX_ACTIVE)


class AdmissionConfigOut(serializers.Serializer):
    """A run's admission limit and its use."""

    runId = serializers.CharField()
    maxActive = serializers.IntegerField(allow_null=True)
    admitted = serializers.IntegerField()
    waiting = serializers.IntegerField()
    updatedAt = serializers.DateTimeField()


class AdmissionRequestIn(StrictSerializer):
    """Body of ``POST /v1/runs/{id}/admissions``."""

    name = StrictCharField(required=False, allow_blank=True, max_length=MAX_NAME_LENGTH, default="")
    key = StrictCharField(required=False, allow_null=True, max_length=MAX_KEY_LENGTH, default=None)
    waitMs = StrictIntegerField(required=False, min_value=0, default=0)
    deadline = serializers.DateTimeField(required=False, allow_null=True, default=None)


class AdmissionOut(serializers.Serializer):
    """An admission: ``run`` is the admitted child run, null until admitted."""

    admissionId = serializers.CharField()
    state = serializers.ChoiceField(choices=AdmissionState.choices)
    position = serializers.IntegerField(allow_null=True)
    run = RunOut(allow_null=True)
    parentRunId = serializers.CharField()
    key = serializers.CharField(allow_null=True)
    name = serializers.CharField()
    deadline = serializers.DateTimeField(allow_null=True)
    createdAt = serializers.DateTimeField()
    admittedAt = serializers.DateTimeField(allow_null=True)
    endedAt = serializers.DateTimeField(allow_null=True)
    endCode = serializers.CharField(allow_null=True)


def present_admission_config(config: AdmissionConfig) -> dict:
    """Return the API shape of a run's admission limit."""
    return {
        "runId": str(config.run_id),
        "maxActive": config.max_active,
        "admitted": config.admitted,
        "waiting": config.waiting,
        "updatedAt": iso(config.updated_at),
    }


def present_admission(admission: Admission) -> dict:
    """Return the API shape of an admission (reads the child run's effective state)."""
    run = None
    if admission.run_id is not None:
        child = admission.run
        run = present_run(child, selectors.runs_effective([child])[child.id])
    return {
        "admissionId": str(admission.id),
        "state": admission.state,
        "position": admission_position(admission),
        "run": run,
        "parentRunId": str(admission.parent_id),
        "key": admission.key,
        "name": admission.name,
        "deadline": iso(admission.deadline),
        "createdAt": iso(admission.created_at),
        "admittedAt": iso(admission.admitted_at),
        "endedAt": iso(admission.ended_at),
        "endCode": admission.end_code,
    }
