"""Reads: what a caller may see, and derived state computed at read time."""

import base64
import binascii
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import Q, QuerySet
from django.db.models.expressions import RawSQL
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from coordination.domain import exceptions
from coordination.domain.ids import path_ids
from coordination.domain.states import Effective, InactiveReason
from coordination.models import (
    Barrier,
    Budget,
    BudgetReservation,
    Event,
    GroupMember,
    Mailbox,
    Message,
    Run,
    Task,
    TaskGroup,
    Timer,
)
from coordination.services import sql
from coordination.services.locking import CHAIN_ACTIVE_SQL, chain_refusal


@dataclass(frozen=True)
class Visibility:
    """What a caller can see: one project, optionally only a run's subtree (bound keys)."""

    project_id: uuid.UUID
    bound_path: str | None = None

    def runs(self) -> QuerySet[Run]:
        """Return the runs the caller can see."""
        queryset = Run.objects.filter(project_id=self.project_id)
        if self.bound_path is not None:
            queryset = queryset.filter(path__startswith=self.bound_path)
        return queryset

    def sees_path(self, path: str) -> bool:
        """Tell whether an object under a run with ``path`` is visible."""
        return self.bound_path is None or path.startswith(self.bound_path)

    def require_project_wide(self, message: str | None = None) -> None:
        """Refuse a key bound to a run what reaches beyond any subtree, with ``PERMISSION_DENIED``.

        The one rule for project-wide configuration (mailboxes, pools, quotas, root runs and
        groups) and project-wide usage (a quota's level): a bound key sees and changes only
        its run and the runs below it. Views name such methods in ``project_wide`` (checked
        by ``HasKeyPermission`` before the body is read) or call this where the body decides.
        """
        if self.bound_path is not None:
            raise exceptions.PermissionDenied(
                message or "A key bound to a run cannot configure or read what the whole project shares."
            )


def parse_id(value: object, *, what: str = "Object") -> uuid.UUID:
    """Parse an opaque id; a malformed one is simply not found."""
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError, AttributeError):
        raise exceptions.NotFound(f"{what} not found.") from None


def run_get(visibility: Visibility, run_id: object) -> Run:
    """Return a visible run, or raise ``NotFound`` (never a hint that it exists elsewhere)."""
    run = visibility.runs().filter(id=parse_id(run_id, what="Run")).first()
    if run is None:
        raise exceptions.NotFound("Run not found.", runId=str(run_id))
    return run


@dataclass(frozen=True)
class RunRef:
    """What never changes about a run: its id, project and path (its chain of ids)."""

    id: uuid.UUID
    project_id: uuid.UUID
    path: str

    @property
    def chain_ids(self) -> list[uuid.UUID]:
        """Return the ids of the root, every ancestor and the run itself, root first."""
        return path_ids(self.path)


# A run's project and path never change and its id is never reused: kept for the life of the
# process (bounded; a full map starts again).
_RUN_REFS: dict[uuid.UUID, RunRef] = {}
_RUN_REFS_MAX = 100_000


def run_ref(visibility: Visibility, run_id: object, *, cached_only: bool = False) -> RunRef | None:
    """Return a visible run's id, project and path, or raise ``NotFound``, like ``run_get``.

    For the hot paths (submit, claim), whose services check the run's state themselves in
    the statement that writes: a run seen before costs no query. ``cached_only`` answers
    None instead of reading a run not seen before (the event loop may call it).
    """
    parsed = parse_id(run_id, what="Run")
    ref = _RUN_REFS.get(parsed)
    if ref is None and cached_only:
        return None
    if ref is None:
        found = Run.objects.filter(id=parsed).values_list("project_id", "path").first()
        if found is not None:
            if len(_RUN_REFS) >= _RUN_REFS_MAX:
                _RUN_REFS.clear()
            ref = _RUN_REFS[parsed] = RunRef(parsed, *found)
    if ref is None or ref.project_id != visibility.project_id or not visibility.sees_path(ref.path):
        raise exceptions.NotFound("Run not found.", runId=str(run_id))
    return ref


@dataclass(frozen=True)
class EffectiveState:
    """A run's effective state: ACTIVE, or INACTIVE with the reason and the run causing it."""

    effective: Effective
    reason: str | None = None
    cause_run_id: uuid.UUID | None = None


_INACTIVE_REASON_BY_CODE = {
    exceptions.ScopeCancelled.code: InactiveReason.CANCELLED,
    exceptions.ScopeCompleted.code: InactiveReason.COMPLETED,
    exceptions.DeadlineExceeded.code: InactiveReason.DEADLINE_EXCEEDED,
}


def runs_effective(runs: Sequence[Run], now: datetime | None = None) -> dict[uuid.UUID, EffectiveState]:
    """Compute the effective state of ``runs`` with one query for all their ancestors."""
    now = now or timezone.now()
    ancestor_ids = {aid for run in runs for aid in run.ancestor_ids}
    by_id = {run.id: run for run in runs}
    missing = ancestor_ids - by_id.keys()
    if missing:
        by_id.update(
            {r.id: r for r in Run.objects.filter(id__in=missing).only("id", "stored_state", "deadline", "path")}
        )
    result = {}
    for run in runs:
        refusal = chain_refusal([by_id[rid] for rid in run.chain_ids], now)
        if refusal is None:
            result[run.id] = EffectiveState(Effective.ACTIVE)
        else:
            reason = _INACTIVE_REASON_BY_CODE[refusal.code]
            result[run.id] = EffectiveState(Effective.INACTIVE, reason, uuid.UUID(refusal.details["runId"]))
    return result


# Cursor pagination -----------------------------------------------------------------------


def _encode_cursor(values: list) -> str:
    raw = json.dumps(values, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str, arity: int) -> list:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = json.loads(base64.urlsafe_b64decode(padded.encode()))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise exceptions.ValidationFailed("Malformed cursor.", cursor="malformed") from None
    if not isinstance(values, list) or len(values) != arity:
        raise exceptions.ValidationFailed("Malformed cursor.", cursor="malformed")
    return values


@dataclass(frozen=True)
class Page:
    """One page of a list and where the next one starts (None on the last page)."""

    items: list
    next_cursor: str | None


def paginate_by_creation(queryset: QuerySet, *, cursor: str | None, limit: int) -> Page:
    """Page ``queryset`` oldest first by ``(created_at, id)``."""
    if cursor:
        created_raw, id_raw = _decode_cursor(cursor, 2)
        try:
            created_at = parse_datetime(created_raw) if isinstance(created_raw, str) else None
        except ValueError:  # well-formed but impossible: a day 32, an offset of 99 hours
            created_at = None
        if created_at is None:
            raise exceptions.ValidationFailed("Malformed cursor.", cursor="malformed")
        try:
            last_id = uuid.UUID(str(id_raw))
        except ValueError:
            raise exceptions.ValidationFailed("Malformed cursor.", cursor="malformed") from None
        queryset = queryset.filter(Q(created_at__gt=created_at) | Q(created_at=created_at, id__gt=last_id))
    items = list(queryset.order_by("created_at", "id")[: limit + 1])
    if len(items) <= limit:
        return Page(items, None)
    items = items[:limit]
    last = items[-1]
    return Page(items, _encode_cursor([last.created_at.isoformat(), str(last.id)]))


def run_list(
    visibility: Visibility, *, parent_id: object = None, state: str | None = None, cursor: str | None, limit: int
) -> Page:
    """List visible runs, optionally the children of one run or those in one stored state."""
    queryset = visibility.runs()
    if parent_id is not None:
        queryset = queryset.filter(parent=run_get(visibility, parent_id))
    if state is not None:
        queryset = queryset.filter(stored_state=state)
    return paginate_by_creation(queryset, cursor=cursor, limit=limit)


# Events ----------------------------------------------------------------------------------

EVENT_CURSOR_START = "0-0"

# The event horizon on PostgreSQL (docs/internals.md, "Events and the cursor"): the oldest
# transaction that the statement's own snapshot sees running *in this database*, or the
# snapshot's xmax when none is. Every event below it is committed and visible to the same
# statement, or is never committed. A transaction known to belong to another database of the
# cluster (its xid is some other database's backend's in ``pg_stat_activity``) is left out: it
# cannot write runstate's events, so a long transaction there no longer stalls the readers
# here. One whose database cannot be told (a prepared transaction, a backend gone since the
# snapshot) still counts, which only delays, as the cluster-wide ``pg_snapshot_xmin`` did.
EVENT_HORIZON_SQL = """(
    SELECT coalesce(min(x::text::bigint), pg_snapshot_xmax(pg_current_snapshot())::text::bigint)
    FROM pg_snapshot_xip(pg_current_snapshot()) AS x
    WHERE xid(x) NOT IN (
        SELECT backend_xid FROM pg_stat_activity
        WHERE backend_xid IS NOT NULL
        AND datid <> (SELECT oid FROM pg_database WHERE datname = current_database())
    )
)"""


# The horizon with whether it is held by a transaction that has ended since the snapshot:
# ``pg_stat_activity`` is read after the snapshot is taken, so a transaction that ends in
# between (its backend shows no id, or a new one) cannot be attributed and counts. It holds a
# reader back for nothing once it has ended: a fresh statement's snapshot no longer sees it
# running. A busy cluster ends many transactions a second, so a one-time read (``GET
# /v1/events`` right after a change) met such a horizon often enough to miss the change.
EVENT_HORIZON_NOW_SQL = f"""
SELECT h, h < pg_snapshot_xmax(pg_current_snapshot())::text::bigint
          AND pg_xact_status(h::text::xid8) IS DISTINCT FROM 'in progress'
FROM (SELECT {EVENT_HORIZON_SQL} AS h) AS horizon
"""
# Reads of the horizon a reader spends while ended transactions hold it, before it takes the last.
EVENT_HORIZON_TRIES = 3


def event_horizon() -> int | None:
    """Return the event horizon now, read anew while an ended transaction holds it (``EVENT_HORIZON_NOW_SQL``).

    None on SQLite, which needs none. A horizon read in one statement is safe to use in a later
    one: every transaction below it had ended at the earlier snapshot, so the later one sees
    all their events. After ``EVENT_HORIZON_TRIES`` reads the last is taken (only a delay).
    """
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        for _ in range(EVENT_HORIZON_TRIES):
            cursor.execute(EVENT_HORIZON_NOW_SQL)
            horizon, ended = cursor.fetchone()
            if not ended:
                break
    return horizon


def _below_event_horizon(queryset: QuerySet[Event], horizon: int | None = None) -> QuerySet[Event]:
    """Keep the events a cursor reader may see now: on PostgreSQL, those below the horizon.

    ``horizon``: one read beforehand (``event_horizon``); else the statement computes its own.
    On SQLite writers are serialized, so every committed event may be seen.
    """
    if connection.vendor != "postgresql":
        return queryset
    # A horizon read beforehand goes in as an InitPlan, as the one computed here does: the
    # planner picks the same index for both, and never folds the bound into the cursor's.
    bound = RawSQL("(SELECT %s::bigint)", [horizon]) if horizon is not None else RawSQL(EVENT_HORIZON_SQL, [])
    return queryset.filter(txid__lt=bound)


_BIGINT_MAX = 2**63 - 1


def _parse_event_cursor(cursor: str | None) -> tuple[int, int]:
    if not cursor:
        return 0, 0
    try:
        txid, event_id = (int(part) for part in cursor.split("-", 1))
    except ValueError:
        raise exceptions.ValidationFailed("Malformed cursor.", after="malformed") from None
    # Both are compared with bigint columns: a larger number is no position, and the database would refuse it.
    if not (0 <= txid <= _BIGINT_MAX and 0 <= event_id <= _BIGINT_MAX):
        raise exceptions.ValidationFailed("Malformed cursor.", after="malformed")
    return txid, event_id


def event_cursor(event: Event) -> str:
    """Return the opaque cursor of ``event``: the reader continues after it."""
    return f"{event.txid}-{event.id}"


def event_list(
    visibility: Visibility,
    *,
    after: str | None,
    types: Iterable[str] = (),
    run_id: object = None,
    limit: int,
) -> tuple[list[Event], str]:
    """Return events after the cursor, oldest first, and the cursor to continue from.

    Only events below the horizon are returned (``EVENT_HORIZON_SQL``: older than every
    transaction still running in this database), so a reader that follows the cursor never
    skips an event.
    """
    _parse_event_cursor(after)  # a malformed cursor is refused before an unknown run
    run_path = run_get(visibility, run_id).path if run_id is not None else None
    query = event_list_query(
        visibility, after=after, types=types, run_path=run_path, limit=limit, horizon=event_horizon()
    )
    events = list(query)
    return events, event_page_cursor(events, after)


def event_list_query(
    visibility: Visibility,
    *,
    after: str | None,
    types: Iterable[str],
    run_path: str | None,
    limit: int,
    horizon: int | None = None,
) -> QuerySet[Event]:
    """Return the query of ``event_list`` with the run's path (and the horizon, ``event_horizon``) already found.

    The hot path runs it on its pool, with the horizon it read there.
    """
    txid, event_id = _parse_event_cursor(after)
    queryset = Event.objects.filter(project_id=visibility.project_id).filter(
        Q(txid__gt=txid) | Q(txid=txid, id__gt=event_id)
    )
    queryset = _below_event_horizon(queryset, horizon)
    types = [t for t in types if t]
    if types:
        queryset = queryset.filter(type__in=types)
    if visibility.bound_path is not None:
        queryset = queryset.filter(run_path__startswith=visibility.bound_path)
    if run_path is not None:
        queryset = queryset.filter(run_path__startswith=run_path)
    return queryset.order_by("txid", "id")[:limit]


def event_page_cursor(events: list[Event], after: str | None) -> str:
    """Return the cursor a reader continues from after the page ``events`` read after ``after``."""
    return event_cursor(events[-1]) if events else (after or EVENT_CURSOR_START)


def event_head(visibility: Visibility) -> str:
    """Return the cursor after the last event a reader may see now: "new events only" start there.

    An event of a transaction still running has a txid above this cursor (it is at or above
    the horizon), so a reader starting here still receives it once it commits.
    """
    return event_head_cursor(list(event_head_query(visibility.project_id)))


def event_head_query(project_id: uuid.UUID) -> QuerySet:
    """Return the query of the head: the ``(txid, id)`` of the project's last event a reader may see now, if any.

    One statement: ``event_head``, ``event_feed_head`` and the hot path's event stream (on its
    pool, ``coordination/api/hot/stream.py``) run it.
    """
    queryset = _below_event_horizon(Event.objects.filter(project_id=project_id))
    return queryset.order_by("-txid", "-id").values_list("txid", "id")[:1]


def event_head_cursor(rows: list[tuple[int, int]]) -> str:
    """Return the cursor of ``event_head_query``'s rows (the start of the log when there are none)."""
    return f"{rows[0][0]}-{rows[0][1]}" if rows else EVENT_CURSOR_START


def event_feed(after: tuple[int, int], limit: int, project_ids: Iterable[uuid.UUID]) -> list[Event]:
    """Return the events of ``project_ids`` after position ``after`` (``(txid, id)``), oldest first.

    Only those a cursor reader may see now (see ``event_list``): the SSE feed of an API
    process reads this once per batch of notifications and serves every stream from it.
    Each project's part is a range of its ``(project_id, txid, id)`` index.
    """
    txid, event_id = after
    queryset = _below_event_horizon(Event.objects.filter(project_id__in=list(project_ids)))
    queryset = queryset.filter(Q(txid__gt=txid) | Q(txid=txid, id__gt=event_id))
    return list(queryset.order_by("txid", "id")[:limit])


# Claim watches: the events that stop a claim its worker did not end itself, which name the
# worker (``heldBy``) and the claim (``claimId``). Both reads go through the partial index
# ``event_held_by``: a drain's other events cost them nothing.


def held_event_feed(
    after: tuple[int, int],
    limit: int,
    project_ids: Iterable[uuid.UUID],
    held_by_prefixes: Iterable[str] | None = None,
    horizon: int | None = None,
) -> list[Event]:
    """Return ``event_feed``'s events that name a held claim (``heldBy``), for every claim watch of a process.

    ``held_by_prefixes``: only those of claims held by workers whose ids start so (a Celery
    worker process's watch: its ids share one prefix); ``horizon``: one read beforehand
    (``event_horizon``), below which every event is then read.
    """
    queryset = _held_events_after(after, project_ids, horizon)
    if held_by_prefixes is not None:
        held_by = Q()
        for prefix in held_by_prefixes:
            held_by |= Q(data__heldBy__startswith=prefix)
        queryset = queryset.filter(held_by)
    return list(queryset.order_by("txid", "id")[:limit])


def held_event_after(after: tuple[int, int], project_ids: Iterable[uuid.UUID], horizon: int | None) -> bool:
    """Tell whether any event naming a held claim, whoever held it, lies after ``after`` below ``horizon``."""
    return _held_events_after(after, project_ids, horizon).exists()


def _held_events_after(after: tuple[int, int], project_ids: Iterable[uuid.UUID], horizon: int | None) -> QuerySet:
    txid, event_id = after
    queryset = Event.objects.filter(project_id__in=list(project_ids), data__has_key="heldBy")
    queryset = _below_event_horizon(queryset, horizon)
    return queryset.filter(Q(txid__gt=txid) | Q(txid=txid, id__gt=event_id))


def held_event_start(horizon: int | None = None) -> tuple[int, int]:
    """Return a position every event committed from now on comes after: where a new claim watch starts.

    On PostgreSQL just below the event horizon (``horizon``, one read beforehand, else read
    now; a transaction still running writes at or above it); it may also come before a few
    events already committed, which a watch reads once. On SQLite, the last event's.
    """
    if horizon is None:
        horizon = event_horizon()
    if horizon is not None:
        return (horizon - 1, _BIGINT_MAX)
    last = Event.objects.order_by("-id").values_list("id", flat=True).first()
    return (0, last or 0)


def held_event_list(visibility: Visibility, *, worker_id: str, after: str, limit: int) -> tuple[list[Event], str]:
    """Return the events after the cursor that name a claim held by ``worker_id``, oldest first, and the next cursor."""
    txid, event_id = _parse_event_cursor(after)
    queryset = Event.objects.filter(project_id=visibility.project_id, data__has_key="heldBy")
    queryset = _below_event_horizon(queryset.filter(Q(txid__gt=txid) | Q(txid=txid, id__gt=event_id)))
    queryset = queryset.filter(data__heldBy=worker_id)
    if visibility.bound_path is not None:
        queryset = queryset.filter(run_path__startswith=visibility.bound_path)
    events = list(queryset.order_by("txid", "id")[:limit])
    return events, event_page_cursor(events, after)


def event_feed_head(project_id: uuid.UUID) -> tuple[int, int]:
    """Return the position after the last event of the project a reader may see now."""
    rows = list(event_head_query(project_id))
    return (rows[0][0], rows[0][1]) if rows else (0, 0)


def event_position(cursor: str) -> tuple[int, int]:
    """Return the ``(txid, id)`` position of an event cursor (``VALIDATION_ERROR`` if malformed)."""
    return _parse_event_cursor(cursor)


def event_cursor_parse(cursor: str) -> None:
    """Raise ``VALIDATION_ERROR`` unless ``cursor`` is a well-formed event cursor."""
    _parse_event_cursor(cursor)


# Work ------------------------------------------------------------------------------------


# A mailbox's name never changes and its id is never reused: names read once are kept for
# the life of the process (bounded; a full map starts again).
_MAILBOX_NAMES: dict[uuid.UUID, str] = {}
_MAILBOX_NAMES_MAX = 10_000


def mailbox_name_cached(mailbox_id: uuid.UUID) -> str | None:
    """Return the name of mailbox ``mailbox_id`` if ``mailbox_names`` read it before, else None (no query)."""
    return _MAILBOX_NAMES.get(mailbox_id)


def mailbox_names(tasks: Iterable[Task]) -> dict[uuid.UUID, str]:
    """Return the names of the mailboxes of ``tasks``, by id: at most one query, none for names read before."""
    wanted = {task.mailbox_id for task in tasks}
    known = {mailbox_id: _MAILBOX_NAMES[mailbox_id] for mailbox_id in wanted if mailbox_id in _MAILBOX_NAMES}
    if len(known) == len(wanted):
        return known
    found = dict(Mailbox.objects.filter(id__in=wanted - known.keys()).values_list("id", "name"))
    if len(_MAILBOX_NAMES) + len(found) > _MAILBOX_NAMES_MAX:
        _MAILBOX_NAMES.clear()
    _MAILBOX_NAMES.update(found)
    return known | found


def task_get(visibility: Visibility, task_id: object) -> Task:
    """Return a visible task, or raise ``NotFound``."""
    task = (
        Task.objects.select_related("mailbox")
        .filter(project_id=visibility.project_id, id=parse_id(task_id, what="Task"))
        .first()
    )
    if task is None or not visibility.sees_path(task.run_path):
        raise exceptions.NotFound("Task not found.", taskId=str(task_id))
    return task


def message_get(visibility: Visibility, message_id: object) -> Message:
    """Return a visible message, or raise ``NotFound``."""
    message = (
        Message.objects.select_related("mailbox")
        .filter(project_id=visibility.project_id, id=parse_id(message_id, what="Message"))
        .first()
    )
    if message is None or not visibility.sees_path(message.run_path):
        raise exceptions.NotFound("Message not found.", messageId=str(message_id))
    return message


def group_get(visibility: Visibility, group_id: object) -> TaskGroup:
    """Return a visible group, or raise ``NotFound``."""
    group = (
        TaskGroup.objects.select_related("mailbox", "scope")
        .filter(project_id=visibility.project_id, id=parse_id(group_id, what="Group"))
        .first()
    )
    if group is None or not visibility.sees_path(group.scope.path):
        raise exceptions.NotFound("Group not found.", groupId=str(group_id))
    return group


def group_is_due(group: TaskGroup, now: datetime | None = None, *, gate_active: bool | None = None) -> bool:
    """Tell whether an undecided group is past its deadline or its gate went inactive.

    ``gate_active``, when the caller read it already (``GROUP_WAIT_SQL``), saves the read of
    the gate's chain.
    """
    if group.state == "FINALIZED":
        return False
    now = now or timezone.now()
    if group.deadline is not None and group.deadline <= now:
        return True
    if gate_active is not None:
        return not gate_active
    return runs_effective([group.scope], now)[group.scope_id].effective != Effective.ACTIVE


# The first read of a wait on the API's hot path (coordination/api/hot/waits.py): one statement
# on its async pool, for a key that sees its whole project (a bound key's visibility needs the
# run path checked, and takes the view). No row: not there, or another project's.


def row_statement(model: type, *, project_id: uuid.UUID, object_id: uuid.UUID) -> tuple[str, dict]:
    """Return the statement reading the row ``object_id`` of ``model`` (a task, barrier, timer) in ``project_id``."""
    statement = (
        f"SELECT {sql.columns(model, 'o')} FROM {model._meta.db_table} o "
        "WHERE o.project_id = %(project_id)s AND o.id = %(id)s"
    )
    return statement, {"project_id": project_id, "id": object_id}


_MEMBER = f"FROM {GroupMember._meta.db_table} gm JOIN {Task._meta.db_table} t ON t.id = gm.task_id"
# A group, its mailbox, whether its gate's chain accepts work (``chain_refusal`` is None) and
# its members in id order as one array per column (``present_group``'s): what ``fresh_group``
# and ``present_group`` read in four statements.
GROUP_WAIT_SQL = f"""
SELECT {sql.columns(TaskGroup, "g")}, {sql.columns(Mailbox, "m")},
    (SELECT {CHAIN_ACTIVE_SQL} FROM {Run._meta.db_table} r
     WHERE r.id = ANY (string_to_array(rtrim(gate.path, '/'), '/')::uuid[])) AS gate_active,
    members.task_ids, members.keys, members.states, members.verdicts, members.lates, members.verdict_ats
FROM {TaskGroup._meta.db_table} g
JOIN {Mailbox._meta.db_table} m ON m.id = g.mailbox_id
JOIN {Run._meta.db_table} gate ON gate.id = g.scope_id
LEFT JOIN LATERAL (
    SELECT array_agg(gm.task_id ORDER BY gm.id) AS task_ids, array_agg(t.key ORDER BY gm.id) AS keys,
        array_agg(t.state ORDER BY gm.id) AS states, array_agg(gm.verdict ORDER BY gm.id) AS verdicts,
        array_agg(gm.late ORDER BY gm.id) AS lates, array_agg(gm.verdict_at ORDER BY gm.id) AS verdict_ats
    {_MEMBER}
    WHERE gm.group_id = g.id
) members ON true
WHERE g.project_id = %(project_id)s AND g.id = %(id)s"""


def group_from_wait_row(row) -> tuple[TaskGroup, bool, list[tuple]]:
    """Return a row of ``GROUP_WAIT_SQL`` as ``(group with its mailbox, gate active, members)``.

    Each member is ``(task_id, key, state, verdict, late, verdict_at)``, as ``present_group`` takes them.
    """
    group, mailbox = sql.build_row(row, TaskGroup, Mailbox)
    group.mailbox = mailbox
    gate_active, *columns = row[len(TaskGroup._meta.concrete_fields) + len(Mailbox._meta.concrete_fields) :]
    return group, gate_active, list(zip(*columns, strict=True)) if columns[0] is not None else []


def barrier_get(visibility: Visibility, barrier_id: object) -> Barrier:
    """Return a visible barrier, or raise ``NotFound``."""
    barrier = Barrier.objects.filter(project_id=visibility.project_id, id=parse_id(barrier_id, what="Barrier")).first()
    if barrier is None or not visibility.sees_path(barrier.run_path):
        raise exceptions.NotFound("Barrier not found.", barrierId=str(barrier_id))
    return barrier


def timer_get(visibility: Visibility, timer_id: object) -> Timer:
    """Return a visible timer, or raise ``NotFound``."""
    timer = Timer.objects.filter(project_id=visibility.project_id, id=parse_id(timer_id, what="Timer")).first()
    if timer is None or not visibility.sees_path(timer.run_path):
        raise exceptions.NotFound("Timer not found.", timerId=str(timer_id))
    return timer


def admission_get(visibility: Visibility, admission_id: object):
    """Return a visible admission (its parent run visible), or raise ``NotFound``."""
    from coordination.models import Admission  # a separate hunk from the shared import line above

    admission = (
        Admission.objects.select_related("run")
        .filter(project_id=visibility.project_id, id=parse_id(admission_id, what="Admission"))
        .first()
    )
    if admission is None or not visibility.sees_path(admission.parent_path):
        raise exceptions.NotFound("Admission not found.", admissionId=str(admission_id))
    return admission


def budget_get(visibility: Visibility, budget_id: object) -> Budget:
    """Return a visible budget, or raise ``NotFound``."""
    budget = Budget.objects.filter(project_id=visibility.project_id, id=parse_id(budget_id, what="Budget")).first()
    if budget is None or not visibility.sees_path(budget.run_path):
        raise exceptions.NotFound("Budget not found.", budgetId=str(budget_id))
    return budget


def reservation_get(visibility: Visibility, reservation_id: object) -> BudgetReservation:
    """Return a visible budget reservation, or raise ``NotFound``."""
    parsed = parse_id(reservation_id, what="Reservation")
    reservation = BudgetReservation.objects.filter(project_id=visibility.project_id, id=parsed).first()
    if reservation is None or not visibility.sees_path(reservation.run_path):
        raise exceptions.NotFound("Reservation not found.", reservationId=str(reservation_id))
    return reservation
