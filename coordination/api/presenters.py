"""Domain objects as API dicts (camelCase keys, RFC 3339 UTC times, string ids)."""

from datetime import UTC, datetime

from coordination.models import Event, Run
from coordination.selectors import EffectiveState, event_cursor


def iso(value: datetime | None) -> str | None:
    """Format a time as RFC 3339 in UTC with a ``Z``."""
    if value is None:
        return None
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def present_run(run: Run, effective: EffectiveState) -> dict:
    """Return the API shape of a run."""
    return {
        "id": str(run.id),
        "name": run.name,
        "parentId": str(run.parent_id) if run.parent_id else None,
        "storedState": run.stored_state,
        "effective": effective.effective,
        "inactiveReason": effective.reason,
        "inactiveRunId": str(effective.cause_run_id) if effective.cause_run_id else None,
        "deadline": iso(run.deadline),
        "childLimit": run.child_limit,
        "createdAt": iso(run.created_at),
        "endedAt": iso(run.ended_at),
        "cancelReason": run.cancel_reason,
    }


def present_event(event: Event) -> dict:
    """Return the API shape of an event."""
    return {
        "id": event_cursor(event),
        "type": event.type,
        "runId": str(event.run_id) if event.run_id else None,
        "subjectId": event.subject_id,
        "data": event.data,
        "createdAt": iso(event.created_at),
    }
