"""Request validation and response shapes (the latter document the OpenAPI schema)."""

import json

from django.conf import settings
from rest_framework import serializers

from coordination.domain.states import (
    BarrierState,
    Effective,
    GroupCondition,
    GroupOutcome,
    GroupState,
    InactiveReason,
    MailboxMode,
    MessageState,
    RunState,
    TaskState,
    TimerState,
    Verdict,
)
from coordination.services.tasks import MAX_SUBMIT_BATCH
from coordination.services.timers import MAX_DELAY_S

MAX_NAME_LENGTH = 200
MAX_REASON_LENGTH = 1000


class StrictSerializer(serializers.Serializer):
    """A request body serializer that rejects fields it does not know."""

    def to_internal_value(self, data):  # noqa: D102
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: "Unknown field." for name in unknown})
        return super().to_internal_value(data)


class _OnlyItsJsonTypes:
    """A body field that takes only the JSON types its schema names.

    DRF's fields convert: a ``CharField`` turns ``5`` into ``"5"``, an ``IntegerField`` takes
    ``"5"``, a ``BooleanField`` takes ``"true"`` and ``1``. A request body is JSON, and the
    schema says which type each field has, so anything else is a 400 (``invalid``).
    """

    json_types: tuple[type, ...] = ()

    def to_internal_value(self, data):  # noqa: D102
        if not isinstance(data, self.json_types) or (isinstance(data, bool) and bool not in self.json_types):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictCharField(_OnlyItsJsonTypes, serializers.CharField):
    json_types = (str,)


class StrictIntegerField(_OnlyItsJsonTypes, serializers.IntegerField):
    json_types = (int, float)  # 5.0 is an integer to JSON Schema; DRF refuses 5.5


class StrictFloatField(_OnlyItsJsonTypes, serializers.FloatField):
    json_types = (int, float)


class StrictBooleanField(_OnlyItsJsonTypes, serializers.BooleanField):
    json_types = (bool,)


MAX_PAYLOAD_BYTES = 256 * 1024
MAX_PAYLOAD_DEPTH = 32


class PayloadField(serializers.JSONField):
    """A JSON payload stored as given: bounded in size and depth, and free of NUL characters.

    PostgreSQL's ``jsonb`` refuses the NUL character; refusing it here makes that a 400 on every
    database instead of a server error on one.
    """

    def to_internal_value(self, data):  # noqa: D102
        value = super().to_internal_value(data)
        self._check(value, depth=0)
        if len(json.dumps(value, separators=(",", ":"))) > MAX_PAYLOAD_BYTES:
            raise serializers.ValidationError(f"At most {MAX_PAYLOAD_BYTES} bytes of JSON.")
        return value

    def _check(self, value, depth: int) -> None:
        if depth > MAX_PAYLOAD_DEPTH:
            raise serializers.ValidationError(f"JSON nested deeper than {MAX_PAYLOAD_DEPTH} levels.")
        if isinstance(value, str):
            if "\x00" in value:
                raise serializers.ValidationError("Null characters are not allowed.")
        elif isinstance(value, dict):
            for key, item in value.items():
                self._check(key, depth + 1)
                self._check(item, depth + 1)
        elif isinstance(value, list):
            for item in value:
                self._check(item, depth + 1)


class ListQuery(serializers.Serializer):
    """``?cursor=&limit=`` of every list."""

    cursor = serializers.CharField(required=False, allow_blank=True, max_length=2000)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=1000, default=100)


def clamp_wait_ms(value: int) -> int:
    """Clamp a ``timeoutMs`` / ``waitMs`` to the server's cap."""
    return min(value, settings.RUNSTATE_MAX_WAIT_MS)


# Runs ------------------------------------------------------------------------------------


class RunChildIn(StrictSerializer):
    """Body of ``POST /v1/runs/{id}/children``."""

    name = StrictCharField(required=False, allow_blank=True, max_length=MAX_NAME_LENGTH, default="")
    deadline = serializers.DateTimeField(required=False, allow_null=True, default=None)
    childLimit = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=1_000_000)


class RunCreateIn(RunChildIn):
    """Body of ``POST /v1/runs``."""

    parentId = StrictCharField(required=False, allow_null=True, max_length=100)


class RunCancelIn(StrictSerializer):
    """Body of ``POST /v1/runs/{id}/cancel``."""

    reason = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=MAX_REASON_LENGTH)


class RunListQuery(ListQuery):
    """Query of ``GET /v1/runs``."""

    parentId = serializers.CharField(required=False, max_length=100)
    state = serializers.ChoiceField(choices=RunState.choices, required=False)


class RunOut(serializers.Serializer):
    """A run."""

    id = serializers.CharField()
    name = serializers.CharField()
    parentId = serializers.CharField(allow_null=True)
    storedState = serializers.ChoiceField(choices=RunState.choices)
    effective = serializers.ChoiceField(choices=Effective.choices)
    inactiveReason = serializers.ChoiceField(choices=InactiveReason.choices, allow_null=True)
    inactiveRunId = serializers.CharField(allow_null=True)
    deadline = serializers.DateTimeField(allow_null=True)
    childLimit = serializers.IntegerField()
    createdAt = serializers.DateTimeField()
    endedAt = serializers.DateTimeField(allow_null=True)
    cancelReason = serializers.CharField(allow_null=True)


class RunPageOut(serializers.Serializer):
    """A page of runs."""

    results = RunOut(many=True)
    nextCursor = serializers.CharField(allow_null=True)


# Events ----------------------------------------------------------------------------------

# An event's cursor (its ``id``) as the schema gives it: ``<txid>-<event id>``, both numbers
# bigints (``selectors.event_cursor_parse``), of at most 18 digits here so that the pattern
# never admits one above the bigint maximum (a txid of 19 digits is centuries of transactions).
EVENT_CURSOR = "[0-9]{1,18}-[0-9]{1,18}"
EVENT_CURSOR_PATTERN = f"^{EVENT_CURSOR}$"


class EventCursorField(serializers.CharField):
    """An event cursor: a ``CharField`` (the view parses it); the schema gives it ``EVENT_CURSOR_PATTERN``."""

    schema_pattern = EVENT_CURSOR_PATTERN


class EventListQuery(serializers.Serializer):
    """Query of ``GET /v1/events``."""

    after = EventCursorField(required=False, allow_blank=True, max_length=100)
    types = serializers.CharField(required=False, allow_blank=True, max_length=2000)
    runId = serializers.CharField(required=False, max_length=100)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=1000, default=100)
    waitMs = serializers.IntegerField(required=False, min_value=0, default=0)


class EventOut(serializers.Serializer):
    """An event."""

    id = serializers.CharField(help_text="Opaque cursor: pass it as `after` to continue.")
    type = serializers.CharField()
    runId = serializers.CharField(allow_null=True)
    subjectId = serializers.CharField()
    data = serializers.JSONField()
    createdAt = serializers.DateTimeField()


class EventPageOut(serializers.Serializer):
    """A page of events; ``nextCursor`` is never null."""

    events = EventOut(many=True)
    nextCursor = serializers.CharField()


# Errors and health -----------------------------------------------------------------------


class ErrorBody(serializers.Serializer):
    """The error itself."""

    code = serializers.CharField()
    message = serializers.CharField()
    details = serializers.DictField()


class ErrorOut(serializers.Serializer):
    """The error envelope of every 4xx/5xx answer."""

    error = ErrorBody()


class HealthOut(serializers.Serializer):
    """Liveness or readiness."""

    status = serializers.CharField()
    checks = serializers.DictField(required=False)


# Mailboxes, tasks, claims ----------------------------------------------------------------

MAX_KEY_LENGTH = 200


class MailboxEnsureIn(StrictSerializer):
    """Body of ``PUT /v1/mailboxes/{name}``."""

    mode = serializers.ChoiceField(choices=MailboxMode.choices)
    leaseTtlMs = StrictIntegerField(required=False, min_value=100, max_value=86_400_000)
    maxAttempts = StrictIntegerField(required=False, min_value=1, max_value=1000)


class MailboxOut(serializers.Serializer):
    """A mailbox."""

    name = serializers.CharField()
    mode = serializers.ChoiceField(choices=MailboxMode.choices)
    leaseTtlMs = serializers.IntegerField()
    maxAttempts = serializers.IntegerField()
    createdAt = serializers.DateTimeField()


ERROR_HELP = (
    "Why the task failed: any JSON value the worker sent to `fail` (an object, a string, a number, "
    "a list or null), stored as given. The service's own failures are `{code, message}` objects "
    "(`lease_expired`); a reader should look for a string `code` only in an object."
)


class TaskSpecIn(StrictSerializer):
    """One task of ``POST /v1/mailboxes/{name}/tasks/batch``."""

    input = PayloadField(required=False, default=dict)
    key = StrictCharField(required=False, allow_null=True, max_length=MAX_KEY_LENGTH, default=None)
    priority = StrictIntegerField(required=False, min_value=-1_000_000, max_value=1_000_000, default=0)
    maxAttempts = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=1000)
    expiresAt = serializers.DateTimeField(required=False, allow_null=True, default=None)


class TaskSubmitIn(TaskSpecIn):
    """Body of ``POST /v1/mailboxes/{name}/tasks``."""

    runId = StrictCharField(max_length=100)


MAX_CLAIM_BATCH = 500  # per HTTP call; the service itself takes up to claims.MAX_BATCH


class TaskBatchIn(StrictSerializer):
    """Body of ``POST /v1/mailboxes/{name}/tasks/batch``: all of them or none."""

    runId = StrictCharField(max_length=100)
    tasks = TaskSpecIn(many=True, min_length=1, max_length=MAX_SUBMIT_BATCH)


class TaskOut(serializers.Serializer):
    """A task."""

    id = serializers.CharField()
    mailbox = serializers.CharField()
    runId = serializers.CharField()
    key = serializers.CharField(allow_null=True)
    input = serializers.JSONField()
    state = serializers.ChoiceField(choices=TaskState.choices)
    outcome = serializers.JSONField(allow_null=True)
    error = serializers.JSONField(allow_null=True, help_text=ERROR_HELP)
    attempts = serializers.IntegerField()
    maxAttempts = serializers.IntegerField()
    priority = serializers.IntegerField()
    groupId = serializers.CharField(allow_null=True)
    createdAt = serializers.DateTimeField()
    startedAt = serializers.DateTimeField(allow_null=True)
    finishedAt = serializers.DateTimeField(allow_null=True)
    expiresAt = serializers.DateTimeField(allow_null=True)
    cancelReason = serializers.CharField(allow_null=True)
    workerId = serializers.CharField(allow_null=True)
    leaseExpiresAt = serializers.DateTimeField(allow_null=True)
    rerunOf = serializers.CharField(allow_null=True, help_text="The task this one reruns; null unless a rerun.")


class TaskCancelIn(StrictSerializer):
    """Body of ``POST /v1/tasks/{id}/cancel``."""

    reason = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=MAX_REASON_LENGTH)
    graceMs = StrictIntegerField(required=False, allow_null=True, min_value=0, max_value=86_400_000)


class TaskRerunIn(StrictSerializer):
    """Body of ``POST /v1/tasks/{id}/rerun``: without ``input``, the old task's input is used."""

    key = StrictCharField(required=False, allow_null=True, max_length=MAX_KEY_LENGTH, default=None)
    input = PayloadField(required=False)


class WaitQuery(serializers.Serializer):
    """``?timeoutMs=`` of a long-poll (clamped to 30 s)."""

    timeoutMs = serializers.IntegerField(required=False, min_value=0, default=0)


class ClaimIn(StrictSerializer):
    """Body of ``POST /v1/mailboxes/{name}/claims``."""

    runId = StrictCharField(max_length=100)
    workerId = StrictCharField(required=False, allow_blank=True, max_length=200, default="")
    leaseTtlMs = StrictIntegerField(required=False, allow_null=True, min_value=100, max_value=86_400_000)
    max = StrictIntegerField(required=False, min_value=1, max_value=100, default=1)
    waitMs = StrictIntegerField(required=False, min_value=0, default=0)


class ClaimOut(serializers.Serializer):
    """A claim: the task and the lease that fences every operation on it."""

    claimId = serializers.CharField()
    attempt = serializers.IntegerField()
    leaseExpiresAt = serializers.DateTimeField()
    cancellationRequested = serializers.BooleanField()
    task = TaskOut()
    traceparent = serializers.CharField(allow_null=True, help_text="The submitter's W3C traceparent, if it sent one")
    tracestate = serializers.CharField(allow_null=True, help_text="The submitter's W3C tracestate, if it sent one")


class ClaimsOut(serializers.Serializer):
    """Claims handed out by one call (possibly none)."""

    claims = ClaimOut(many=True)


class TasksOut(serializers.Serializer):
    """Tasks, in the order of the request."""

    tasks = TaskOut(many=True)


class ClaimCompleteItemIn(StrictSerializer):
    """One item of ``POST /v1/claims/complete``."""

    claimId = StrictCharField(max_length=200)
    outcome = PayloadField(required=False, allow_null=True, default=None)


class ClaimsCompleteIn(StrictSerializer):
    """Body of ``POST /v1/claims/complete``: each item is fenced and decided on its own."""

    items = ClaimCompleteItemIn(many=True, min_length=1, max_length=MAX_CLAIM_BATCH)


class ClaimRenewItemIn(StrictSerializer):
    """One item of ``POST /v1/claims/renew``."""

    claimId = StrictCharField(max_length=200)
    leaseTtlMs = StrictIntegerField(required=False, allow_null=True, min_value=100, max_value=86_400_000)


class ClaimsRenewIn(StrictSerializer):
    """Body of ``POST /v1/claims/renew``: each item is fenced and decided on its own."""

    items = ClaimRenewItemIn(many=True, min_length=1, max_length=MAX_CLAIM_BATCH)


class ItemErrorOut(serializers.Serializer):
    """Why one item of a batch was refused: the code and message it would have had alone."""

    code = serializers.CharField()
    message = serializers.CharField()


class ClaimCompleteResultOut(serializers.Serializer):
    """One item's answer: ``ok`` with the task, or not ``ok`` with the error."""

    claimId = serializers.CharField()
    ok = serializers.BooleanField()
    task = TaskOut(required=False)
    error = ItemErrorOut(required=False)


class ClaimsCompleteOut(serializers.Serializer):
    """Per-item answers, in the order of the request."""

    results = ClaimCompleteResultOut(many=True)


class ClaimRenewResultOut(serializers.Serializer):
    """One item's answer: ``ok`` with the renewed claim, or not ``ok`` with the error."""

    claimId = serializers.CharField()
    ok = serializers.BooleanField()
    claim = ClaimOut(required=False)
    error = ItemErrorOut(required=False)


class ClaimsRenewOut(serializers.Serializer):
    """Per-item answers, in the order of the request."""

    results = ClaimRenewResultOut(many=True)


class RenewIn(StrictSerializer):
    """Body of ``POST /v1/claims/{id}/renew``."""

    leaseTtlMs = StrictIntegerField(required=False, allow_null=True, min_value=100, max_value=86_400_000)


class CompleteIn(StrictSerializer):
    """Body of ``POST /v1/claims/{id}/complete``."""

    outcome = PayloadField(required=False, allow_null=True, default=None)


class FailIn(StrictSerializer):
    """Body of ``POST /v1/claims/{id}/fail``."""

    error = PayloadField(required=False, allow_null=True, default=None, help_text=ERROR_HELP)
    retry = StrictBooleanField(required=False, default=False)
    retryDelayMs = StrictIntegerField(required=False, min_value=0, max_value=86_400_000, default=0)


# Messages --------------------------------------------------------------------------------


class MessageSendIn(StrictSerializer):
    """Body of ``POST /v1/mailboxes/{name}/messages``."""

    runId = StrictCharField(max_length=100)
    body = PayloadField()
    key = StrictCharField(required=False, allow_null=True, max_length=MAX_KEY_LENGTH, default=None)


class MessageOut(serializers.Serializer):
    """A queue message."""

    id = serializers.CharField()
    mailbox = serializers.CharField()
    runId = serializers.CharField()
    key = serializers.CharField(allow_null=True)
    body = serializers.JSONField()
    state = serializers.ChoiceField(choices=MessageState.choices)
    attempts = serializers.IntegerField(help_text="How many times the message was received.")
    createdAt = serializers.DateTimeField()
    visibleAt = serializers.DateTimeField(help_text="When it can be received (again).")
    finishedAt = serializers.DateTimeField(allow_null=True)
    deadLetterReason = serializers.CharField(allow_null=True)


class ReceiveIn(StrictSerializer):
    """Body of ``POST /v1/mailboxes/{name}/deliveries``."""

    runId = StrictCharField(max_length=100)
    max = StrictIntegerField(required=False, min_value=1, max_value=100, default=1)
    visibilityMs = StrictIntegerField(required=False, allow_null=True, min_value=100, max_value=86_400_000)
    waitMs = StrictIntegerField(required=False, min_value=0, default=0)


class DeliveryOut(serializers.Serializer):
    """A message handed out under a visibility lease; ``deliveryId`` fences every later operation."""

    deliveryId = serializers.CharField()
    messageId = serializers.CharField()
    body = serializers.JSONField()
    attempt = serializers.IntegerField()
    visibleUntil = serializers.DateTimeField()
    traceparent = serializers.CharField(allow_null=True, help_text="The sender's W3C traceparent, if it sent one")
    tracestate = serializers.CharField(allow_null=True, help_text="The sender's W3C tracestate, if it sent one")


class DeliveriesOut(serializers.Serializer):
    """Deliveries handed out by one receive (possibly none)."""

    deliveries = DeliveryOut(many=True)


class DeliveryCompleteIn(StrictSerializer):
    """Body of ``POST /v1/deliveries/{id}/complete`` (no fields)."""


class DeliveryRetryIn(StrictSerializer):
    """Body of ``POST /v1/deliveries/{id}/retry``."""

    delayMs = StrictIntegerField(required=False, min_value=0, max_value=86_400_000, default=0)


class DeliveryRejectIn(StrictSerializer):
    """Body of ``POST /v1/deliveries/{id}/reject``."""

    reason = StrictCharField(required=False, allow_null=True, allow_blank=True, max_length=MAX_REASON_LENGTH)


class DeliveryExtendIn(StrictSerializer):
    """Body of ``POST /v1/deliveries/{id}/extend``: the new visibility, counted from now."""

    visibilityMs = StrictIntegerField(min_value=100, max_value=86_400_000)


# Groups ----------------------------------------------------------------------------------


class GroupCreateIn(StrictSerializer):
    """Body of ``POST /v1/groups``."""

    mailbox = StrictCharField(max_length=100)
    condition = serializers.ChoiceField(choices=GroupCondition.choices)
    threshold = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=100)
    expectedMembers = StrictIntegerField(required=False, allow_null=True, min_value=1, max_value=100)
    deadline = serializers.DateTimeField(required=False, allow_null=True, default=None)
    parentScopeId = StrictCharField(required=False, allow_null=True, max_length=100)
    name = StrictCharField(required=False, allow_blank=True, max_length=MAX_NAME_LENGTH, default="")


class GroupMemberOut(serializers.Serializer):
    """A member as the group shows it."""

    taskId = serializers.CharField()
    key = serializers.CharField(allow_null=True)
    state = serializers.ChoiceField(choices=TaskState.choices)
    verdict = serializers.ChoiceField(choices=Verdict.choices, allow_null=True)
    late = serializers.BooleanField()
    verdictAt = serializers.DateTimeField(allow_null=True)


class GroupOut(serializers.Serializer):
    """A group with every member."""

    id = serializers.CharField()
    name = serializers.CharField()
    scopeId = serializers.CharField(help_text="The gate run: workers attach to it to receive the members.")
    parentScopeId = serializers.CharField(allow_null=True)
    mailbox = serializers.CharField()
    condition = serializers.ChoiceField(choices=GroupCondition.choices)
    threshold = serializers.IntegerField(allow_null=True)
    expectedMembers = serializers.IntegerField(allow_null=True)
    deadline = serializers.DateTimeField(allow_null=True)
    state = serializers.ChoiceField(choices=GroupState.choices)
    outcome = serializers.ChoiceField(choices=GroupOutcome.choices, allow_null=True)
    outcomeReason = serializers.CharField(allow_null=True)
    createdAt = serializers.DateTimeField()
    closedAt = serializers.DateTimeField(allow_null=True)
    finalizedAt = serializers.DateTimeField(allow_null=True)
    members = GroupMemberOut(many=True)


class GroupMemberSubmitIn(StrictSerializer):
    """Body of ``POST /v1/groups/{id}/members``."""

    input = PayloadField(required=False, default=dict)
    key = StrictCharField(required=False, allow_null=True, max_length=MAX_KEY_LENGTH, default=None)


class GroupJoinIn(StrictSerializer):
    """Body of ``POST /v1/groups/{id}/join``."""

    taskId = StrictCharField(max_length=100)


class MemberTaskOut(TaskOut):
    """A member's task and the group's state after the submit or join."""

    groupState = serializers.ChoiceField(choices=GroupState.choices)


class GroupDecisionOut(serializers.Serializer):
    """The answer of close and seal."""

    state = serializers.ChoiceField(choices=GroupState.choices)
    outcome = serializers.ChoiceField(choices=GroupOutcome.choices, allow_null=True)
    outcomeReason = serializers.CharField(allow_null=True)


class VerdictOut(serializers.Serializer):
    """The answer of accept and reject."""

    taskId = serializers.CharField()
    verdict = serializers.ChoiceField(choices=Verdict.choices)
    late = serializers.BooleanField()
    groupState = serializers.ChoiceField(choices=GroupState.choices)
    outcome = serializers.ChoiceField(choices=GroupOutcome.choices, allow_null=True)
    outcomeReason = serializers.CharField(allow_null=True)


# Barriers and timers ---------------------------------------------------------------------


class BarrierCreateIn(StrictSerializer):
    """Body of ``POST /v1/barriers``."""

    runId = StrictCharField(max_length=100)
    target = StrictIntegerField(min_value=1, max_value=100_000)
    name = StrictCharField(required=False, allow_blank=True, max_length=MAX_NAME_LENGTH, default="")


class BarrierArriveIn(StrictSerializer):
    """Body of ``POST /v1/barriers/{id}/arrive``."""

    key = StrictCharField(max_length=MAX_KEY_LENGTH)


class BarrierOut(serializers.Serializer):
    """A barrier in its current epoch."""

    id = serializers.CharField()
    runId = serializers.CharField()
    name = serializers.CharField()
    target = serializers.IntegerField()
    epoch = serializers.IntegerField()
    arrivals = serializers.IntegerField()
    state = serializers.ChoiceField(choices=BarrierState.choices)
    releasedAt = serializers.DateTimeField(allow_null=True)
    createdAt = serializers.DateTimeField()


class TimerCreateIn(StrictSerializer):
    """Body of ``POST /v1/timers``: exactly one of ``at`` and ``afterSeconds``."""

    runId = StrictCharField(max_length=100)
    at = serializers.DateTimeField(required=False, allow_null=True, default=None)
    afterSeconds = StrictFloatField(required=False, allow_null=True, default=None, min_value=0)

    # What timers.timer_create checks beyond the fields, for the OpenAPI schema (coordination/api/schema.py):
    # exactly one of the two not null, and a delay of at most MAX_DELAY_S.
    schema_constraints = {
        "properties": {"afterSeconds": {"maximum": MAX_DELAY_S}},
        "oneOf": [
            {"required": ["at"], "properties": {"at": {"type": "string"}}},
            {"required": ["afterSeconds"], "properties": {"afterSeconds": {"type": "number"}}},
        ],
    }


class TimerOut(serializers.Serializer):
    """A timer."""

    id = serializers.CharField()
    runId = serializers.CharField()
    state = serializers.ChoiceField(choices=TimerState.choices)
    fireAt = serializers.DateTimeField()
    firedAt = serializers.DateTimeField(allow_null=True)
    acknowledgedAt = serializers.DateTimeField(allow_null=True)
    createdAt = serializers.DateTimeField()
