"""Queue messages: send, receive, complete, retry, reject. The only writer of ``Message.state``."""

from django.db.models import Q

from coordination.models import Event, Message
from coordination.services.cascade import SubtreeEnd
from coordination.services.events import events_record_many
from coordination.states import MessageState, RunState

CASCADE_CHUNK = 2000


def messages_cancel_subtree(end: SubtreeEnd) -> None:
    """Cancel the subtree's queued messages (in-flight ones finish through their delivery)."""
    cause = "run_cancelled" if end.state == RunState.CANCELLED else "run_completed"
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
