"""Queue messages: send, receive, complete, retry, reject, extend. The only writer of ``Message.state``.

A delivery is ``(message id, attempt)``: every receive adds one to ``attempts`` and hands the
message out until ``visible_at``; once that passes without an answer the message is
delivered again. Each operation on a delivery locks the message and checks that fence, so a
consumer whose visibility ran out (or whose message was handed to someone else) changes
nothing and hears ``LEASE_LOST`` or, for a complete, the run's refusal code.

A message delivered its mailbox's ``maxAttempts`` times without completion (retried, or its
visibility run out) is dead-lettered with reason ``max_attempts`` instead of being handed
out again (DESIGN.md "Mailboxes"): by the retry itself, by the next receive that finds it,
or by the lease sweep. ``_exhausted`` is that rule, the one place it is written.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction
from django.db.models import BooleanField, F, Q
from django.db.models.expressions import RawSQL
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.ids import fence_id, parse_fence_id
from coordination.domain.states import MailboxMode, MessageState, RunState
from coordination.models import Event, Mailbox, Message, Run
from coordination.plumbing.tracing import NO_TRACE, TraceContext
from coordination.services.cascade import SubtreeEnd, cascade_step, subtree_rows_end
from coordination.services.events import event_for, events_record_many
from coordination.services.locking import chain_refusal, run_chain_lock, run_chain_lock_active
from coordination.services.mailboxes import validate_lease_ttl_ms
from coordination.services.rules import Clause, Rule
from coordination.services.sql import columns, fast_paths_enabled, fetch_models, literal

MAX_DELIVERIES_PER_CALL = 100
MAX_DELAY_MS = 24 * 3600 * 1000
CASCADE_CHUNK = 2000
RECEIVABLE = (MessageState.QUEUED, MessageState.IN_FLIGHT)
MAX_ATTEMPTS_REASON = "max_attempts"


def _exhausted(message: Message, mailbox: Mailbox) -> bool:
    """Tell whether ``message`` has been delivered as often as its mailbox allows."""
    return message.attempts >= mailbox.max_attempts


def _dead_letter(messages: list[Message], now: datetime, reason: str | None) -> None:
    """Dead-letter ``messages`` (locked by the caller) with ``reason``, and record each one's event."""
    if not messages:
        return
    Message.objects.filter(id__in=[m.id for m in messages]).update(
        state=MessageState.DEAD_LETTERED, dead_letter_reason=reason, finished_at=now
    )
    for message in messages:
        message.state, message.dead_letter_reason, message.finished_at = MessageState.DEAD_LETTERED, reason, now
    events_record_many([event_for(m, "message.dead_lettered", attempt=m.attempts, reason=reason) for m in messages])


@dataclass(frozen=True)
class Delivery:
    """A message handed to a consumer until ``visible_until``: ``delivery_id`` fences every later operation."""

    message: Message
    attempt: int
    visible_until: datetime

    @property
    def delivery_id(self) -> str:
        """Return the opaque delivery id."""
        return delivery_id_for(self.message.id, self.attempt)


def delivery_id_for(message_id: uuid.UUID, attempt: int) -> str:
    """Return the delivery id of ``attempt`` on ``message_id``."""
    return fence_id("d", message_id, attempt)


def parse_delivery_id(delivery_id: str) -> tuple[uuid.UUID, int]:
    """Split a delivery id into message id and attempt; a malformed one is ``NOT_FOUND``."""
    try:
        return parse_fence_id("d", delivery_id)
    except ValueError:
        raise exceptions.NotFound("Delivery not found.", deliveryId=str(delivery_id)) from None


def _record(message: Message, type: str, **data) -> None:
    events_record_many([event_for(message, type, **data)])


# Send ------------------------------------------------------------------------------------


@transaction.atomic
def message_send(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    body: object,
    key: str | None = None,
    trace: TraceContext = NO_TRACE,
) -> tuple[Message, bool]:
    """Enqueue a message under ``run_id``; return it and whether it was created.

    The same ``key`` with the same body returns the existing message; with another body it
    is ``KEY_CONFLICT``. ``trace`` is the sender's W3C context, which a delivery answers.
    """
    if mailbox.mode != MailboxMode.QUEUE:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds tasks, not messages.")
    if key is not None:
        existing = _message_with_key(mailbox, run_id, key, body)
        if existing is not None:
            return existing, False
    # Sending is new work: hold the chain so a cancel waits for us (and its cascade then
    # cancels this message) or has already committed and refuses us here.
    run = run_chain_lock_active(run_id, project_id=project_id)[-1]
    now = timezone.now()
    message = Message(
        project_id=project_id,
        mailbox=mailbox,
        run_id=run.id,
        run_path=run.path,
        key=key,
        body=body,
        created_at=now,
        visible_at=now,
        traceparent=trace.traceparent,
        tracestate=trace.tracestate,
    )
    try:
        with transaction.atomic():
            message.save(force_insert=True)
    except IntegrityError:
        # A concurrent send with the same key won; answer as an idempotent resend.
        existing = _message_with_key(mailbox, run_id, key, body) if key is not None else None
        if existing is None:
            raise
        return existing, False
    _record(message, "message.sent", mailbox=mailbox.name, key=key)
    return message, True


def _message_with_key(mailbox: Mailbox, run_id: uuid.UUID, key: str, body: object) -> Message | None:
    existing = Message.objects.filter(mailbox=mailbox, run_id=run_id, key=key).first()
    if existing is not None and existing.body != body:
        raise exceptions.KeyConflict(key=key, messageId=str(existing.id))
    return existing


# Receive ---------------------------------------------------------------------------------


@transaction.atomic
def message_receive(
    *,
    project_id: uuid.UUID,
    mailbox: Mailbox,
    run_id: uuid.UUID,
    max_messages: int = 1,
    visibility_ms: int | None = None,
) -> list[Delivery]:
    """Receive up to ``max_messages`` visible messages of exactly ``run_id``, oldest first.

    An in-flight message whose visibility ran out is delivered again with the next attempt.
    Each delivery hides its message for ``visibility_ms`` (default: the mailbox's lease TTL).
    """
    if mailbox.mode != MailboxMode.QUEUE:
        raise exceptions.MailboxModeConflict(f"Mailbox '{mailbox.name}' holds tasks, not messages.")
    validate_lease_ttl_ms(visibility_ms, field="visibilityMs")
    if not 1 <= max_messages <= MAX_DELIVERIES_PER_CALL:
        raise exceptions.ValidationFailed("Invalid max.", max=f"must be between 1 and {MAX_DELIVERIES_PER_CALL}")
    # Receiving is new work: hold the chain so a cancel waits for us or refuses us.
    run_chain_lock_active(run_id, project_id=project_id)
    now = timezone.now()
    # SKIP LOCKED: a row another receiver holds is theirs; we never wait for it. A row it
    # committed meanwhile is re-checked against visible_at <= now, so it is not taken twice.
    receivable = (
        Message.objects.filter(mailbox=mailbox, run_id=run_id, state__in=RECEIVABLE, visible_at__lte=now)
        .order_by("created_at", "id")
        .select_for_update(skip_locked=True)
    )
    candidates: list[Message] = []
    exhausted: list[Message] = []
    while len(candidates) < max_messages:
        wanted = max_messages - len(candidates)
        batch = list(receivable.exclude(id__in=[m.id for m in candidates + exhausted])[:wanted])
        spent = [m for m in batch if _exhausted(m, mailbox)]
        candidates += [m for m in batch if not _exhausted(m, mailbox)]
        exhausted += spent
        if len(batch) < wanted or not spent:
            break
    # A message delivered maxAttempts times is dead-lettered here rather than handed out again.
    _dead_letter(exhausted, now, MAX_ATTEMPTS_REASON)
    visible_until = now + timedelta(milliseconds=visibility_ms or mailbox.lease_ttl_ms)
    if candidates:
        Message.objects.filter(id__in=[m.id for m in candidates]).update(
            state=MessageState.IN_FLIGHT, attempts=F("attempts") + 1, visible_at=visible_until
        )
    deliveries = []
    for message in candidates:
        message.state = MessageState.IN_FLIGHT
        message.attempts += 1
        message.visible_at = visible_until
        deliveries.append(Delivery(message, message.attempts, visible_until))
    events_record_many([event_for(d.message, "message.received", attempt=d.attempt) for d in deliveries])
    return deliveries


# Operations on a delivery ----------------------------------------------------------------


@dataclass(frozen=True)
class _LockedDelivery:
    message: Message
    held: bool  # the delivery is still the message's current, unexpired one
    refusal: exceptions.Conflict | None  # what the run answers to new work; None when active
    now: datetime


# The fence: the delivery ``(message id, attempt)`` is still the message's current one and its
# visibility has not run out. ``_lock_delivery`` calls it on the row it locked, ``EXTEND_SQL``
# renders it.
DELIVERY_HOLDS = Rule(
    Clause("{t}.attempts = {attempt}", lambda message, now, attempt: message.attempts == attempt),
    Clause(
        f"{{t}}.state = {literal(MessageState.IN_FLIGHT)}",
        lambda message, now, **_: message.state == MessageState.IN_FLIGHT,
    ),
    Clause("{t}.visible_at > %(now)s", lambda message, now, **_: message.visible_at > now),
)


def _lock_delivery(project_id: uuid.UUID, delivery_id: str) -> _LockedDelivery:
    """Lock the delivery's run chain, then its message, and check the fence."""
    message_id, attempt = parse_delivery_id(delivery_id)
    run_id = Message.objects.filter(id=message_id, project_id=project_id).values_list("run_id", flat=True).first()
    if run_id is None:
        raise exceptions.NotFound("Delivery not found.", deliveryId=str(delivery_id))
    # The chain comes first (house lock order). Holding it, a cancel of any run in the chain
    # waits for us, so what we decide from the chain still holds at commit: a retry can never
    # queue a message behind a cascade that has already passed over the subtree.
    chain = run_chain_lock(run_id, project_id=project_id)
    # The row lock serializes us with receivers, other operations on this delivery and sweeps.
    message = Message.objects.select_for_update().get(id=message_id)
    now = timezone.now()
    return _LockedDelivery(message, DELIVERY_HOLDS(message, now, attempt=attempt), chain_refusal(chain, now), now)


def _lease_lost(locked: _LockedDelivery, delivery_id: str) -> exceptions.LeaseLost:
    message = locked.message
    return exceptions.LeaseLost(
        "The delivery's visibility lease is no longer held.",
        deliveryId=str(delivery_id),
        messageId=str(message.id),
        state=message.state,
    )


@transaction.atomic
def delivery_complete(*, project_id: uuid.UUID, delivery_id: str) -> Message:
    """Acknowledge the delivery: the message is ``COMPLETED``.

    Refused with the run's code once the run is inactive (DESIGN.md "Precise points"), and
    ``LEASE_LOST`` when the delivery is stale or its visibility ran out.
    """
    locked = _lock_delivery(project_id, delivery_id)
    if locked.refusal is not None:
        raise locked.refusal
    if not locked.held:
        raise _lease_lost(locked, delivery_id)
    message = locked.message
    message.state = MessageState.COMPLETED
    message.finished_at = locked.now
    message.save(update_fields=["state", "finished_at"])
    _record(message, "message.completed", attempt=message.attempts)
    return message


@transaction.atomic
def delivery_retry(*, project_id: uuid.UUID, delivery_id: str, delay_ms: int = 0) -> Message:
    """Put the message back in the queue, visible again after ``delay_ms``.

    The delivery that was the message's last allowed one dead-letters it instead
    (``max_attempts``).

    Allowed after the run went inactive, but such a message can never be received again:
    it is ``CANCELLED`` instead.
    """
    if not 0 <= delay_ms <= MAX_DELAY_MS:
        raise exceptions.ValidationFailed("Invalid delay.", delayMs=f"must be between 0 and {MAX_DELAY_MS}")
    locked = _lock_delivery(project_id, delivery_id)
    if not locked.held:
        raise _lease_lost(locked, delivery_id)
    message = locked.message
    if _exhausted(message, message.mailbox):  # before the run's state, as in the sweeps
        _dead_letter([message], locked.now, MAX_ATTEMPTS_REASON)
        return message
    if locked.refusal is None:
        message.state = MessageState.QUEUED
        message.visible_at = locked.now + timedelta(milliseconds=delay_ms)
        message.save(update_fields=["state", "visible_at"])
        _record(message, "message.retried", attempt=message.attempts, delayMs=delay_ms)
        return message
    message.state = MessageState.CANCELLED
    message.finished_at = locked.now
    message.save(update_fields=["state", "finished_at"])
    _record(message, "message.cancelled", cause="retried_after_run_ended", code=locked.refusal.code)
    return message


@transaction.atomic
def delivery_reject(*, project_id: uuid.UUID, delivery_id: str, reason: str | None = None) -> Message:
    """Dead-letter the message; it stays readable. Allowed after the run went inactive."""
    locked = _lock_delivery(project_id, delivery_id)
    if not locked.held:
        raise _lease_lost(locked, delivery_id)
    _dead_letter([locked.message], locked.now, reason)
    return locked.message


# Extend: the delivery's visibility, fenced like a claim's renewal ----------------------------

# The delivery (message id, attempt) is still the message's current, unexpired one and its
# run chain is active: ``DELIVERY_HOLDS`` plus the refusal check, in one statement. A
# cancel does not touch in-flight messages, so the chain must be read here (a held task's
# deadline stands for it in claims; a message has no such column). It is read, not locked:
# an extend that commits just before a concurrent cancel only moves ``visible_at`` of a
# message the cancel leaves in flight anyway, as if it had run first. Zero rows means
# "something else": the careful path then decides between the run's code and LEASE_LOST.
EXTEND_SQL = f"""
UPDATE coordination_message m
SET visible_at = %(visible_until)s
WHERE m.id = %(message_id)s AND m.project_id = %(project_id)s
  AND {DELIVERY_HOLDS.sql("m", attempt="%(attempt)s")}
  AND NOT EXISTS (
      SELECT 1 FROM coordination_run r
      WHERE r.id = ANY (string_to_array(rtrim(m.run_path, '/'), '/')::uuid[])
        AND (r.stored_state <> {literal(RunState.ACTIVE)} OR r.deadline <= %(now)s)
  )
RETURNING {columns(Message, "m")}
"""


def delivery_extend(*, project_id: uuid.UUID, delivery_id: str, visibility_ms: int) -> Delivery:
    """Hide the delivery's message for ``visibility_ms`` more from now; return the delivery.

    Fenced by the delivery's attempt: once the message was redelivered, acknowledged,
    retried or rejected, or its visibility ran out, the extend is ``LEASE_LOST``; under an
    inactive run it answers the run's code (DESIGN.md "Precise points").
    """
    validate_lease_ttl_ms(visibility_ms, field="visibilityMs")
    if visibility_ms is None:
        raise exceptions.ValidationFailed("Invalid visibility.", visibilityMs="is required")
    if fast_paths_enabled():
        message_id, attempt = parse_delivery_id(delivery_id)
        now = timezone.now()
        visible_until = now + timedelta(milliseconds=visibility_ms)
        rows = fetch_models(
            Message,
            EXTEND_SQL,
            {
                "message_id": message_id,
                "project_id": project_id,
                "attempt": attempt,
                "now": now,
                "visible_until": visible_until,
            },
        )
        if rows:
            return Delivery(rows[0][0], attempt, visible_until)
    return _delivery_extend_careful(project_id=project_id, delivery_id=delivery_id, visibility_ms=visibility_ms)


@transaction.atomic
def _delivery_extend_careful(*, project_id: uuid.UUID, delivery_id: str, visibility_ms: int) -> Delivery:
    locked = _lock_delivery(project_id, delivery_id)
    # Extending keeps work going, so like a complete it is refused once the run is inactive.
    if locked.refusal is not None:
        raise locked.refusal
    if not locked.held:
        raise _lease_lost(locked, delivery_id)
    message = locked.message
    message.visible_at = locked.now + timedelta(milliseconds=visibility_ms)
    message.save(update_fields=["visible_at"])
    return Delivery(message, message.attempts, message.visible_at)


# Sweep: one small batch per transaction, skipping rows another sweeper holds ----------------


def _run_chain_inactive(now: datetime) -> RawSQL:
    """Return a condition on a message: its run or an ancestor is cancelled, completed or past its deadline."""
    message, run = Message._meta.db_table, Run._meta.db_table
    if connection.vendor == "postgresql":
        # The chain's ids are the path's parts: primary-key lookups, at most one per level.
        in_chain = f"r.id = ANY(string_to_array(rtrim({message}.run_path, '/'), '/')::uuid[])"
    else:
        in_chain = f"substr({message}.run_path, 1, length(r.path)) = r.path"
    sql = (
        f"EXISTS (SELECT 1 FROM {run} r WHERE {in_chain}"
        f" AND (r.stored_state <> '{RunState.ACTIVE}' OR r.deadline <= %s))"
    )
    return RawSQL(sql, [now], output_field=BooleanField())


@transaction.atomic
def messages_cancel_orphaned_in_flight(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Cancel in-flight messages whose visibility ran out under an inactive run; return how many.

    Nobody can receive them again (receiving is new work), so they would stay in flight
    forever. A run never becomes active again, so the chain needs no lock here.
    """
    now = now or timezone.now()
    due = list(
        Message.objects.filter(state=MessageState.IN_FLIGHT, visible_at__lte=now)
        # An exhausted message is dead-lettered instead (messages_dead_letter_exhausted).
        .filter(attempts__lt=F("mailbox__max_attempts"))
        .filter(_run_chain_inactive(now))
        .order_by("id")
        .select_for_update(skip_locked=True, of=("self",))[:batch_size]
    )
    if due:
        Message.objects.filter(id__in=[m.id for m in due]).update(state=MessageState.CANCELLED, finished_at=now)
    events_record_many([event_for(m, "message.cancelled", cause="visibility_expired_run_inactive") for m in due])
    return len(due)


@transaction.atomic
def messages_dead_letter_exhausted(*, now: datetime | None = None, batch_size: int = 500) -> int:
    """Dead-letter in-flight messages whose last allowed delivery ran out; return how many.

    A receive would dead-letter them when it came to them; this sweep does it for a queue
    nobody receives from any more, whatever the state of the message's run.
    """
    now = now or timezone.now()
    due = list(
        Message.objects.filter(
            state=MessageState.IN_FLIGHT, visible_at__lte=now, attempts__gte=F("mailbox__max_attempts")
        )
        .order_by("id")
        .select_for_update(skip_locked=True, of=("self",))[:batch_size]
    )
    _dead_letter(due, now, MAX_ATTEMPTS_REASON)
    return len(due)


# Run cascade -----------------------------------------------------------------------------


@cascade_step
def messages_cancel_subtree(end: SubtreeEnd) -> None:
    """Cancel the subtree's queued messages (in-flight ones finish through their delivery)."""
    if connection.vendor == "postgresql":  # one statement, see subtree_rows_end
        subtree_rows_end(
            end,
            Message,
            states=[MessageState.QUEUED],
            final_state=MessageState.CANCELLED,
            event_type="message.cancelled",
            also_set="finished_at = %(now)s",
        )
        return
    cause = end.cause
    rows = list(
        Message.objects.filter(Q(run_path__startswith=end.path_prefix), state=MessageState.QUEUED)
        .order_by("id")
        .select_for_update()
        .values_list("id", "project_id", "run_id", "run_path")
    )
    for start in range(0, len(rows), CASCADE_CHUNK):
        chunk = rows[start : start + CASCADE_CHUNK]
        Message.objects.filter(id__in=[row[0] for row in chunk]).update(
            state=MessageState.CANCELLED, finished_at=end.now
        )
        events_record_many(
            [
                Event(
                    project_id=project_id,
                    type="message.cancelled",
                    run_id=run_id,
                    run_path=run_path,
                    subject_id=str(message_id),
                    data={"reason": end.reason, "cause": cause},
                    created_at=end.now,
                )
                for message_id, project_id, run_id, run_path in chunk
            ]
        )
