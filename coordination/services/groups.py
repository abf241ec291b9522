"""Task groups, decided exactly once. The only writer of ``TaskGroup.state``.

Every operation that can decide a group takes the locks in the house order: the gate's run
chain (ancestors ``FOR KEY SHARE``, the gate ``FOR UPDATE``, since finalizing cancels it),
then the group row, then task rows. ``group_evaluate`` is the one place where the condition
table is applied; it runs inside every transaction that can change its inputs, and reads
the group's counters (docs/internals.md, "Group counters"). The single-statement verdict
(``FAST_VERDICT_SQL``) only asks the table's SQL twin whether it would decide, and leaves
every verdict that would to the careful transaction.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.group_rules import GroupCounts, MemberFacts, decide, member_counts
from coordination.domain.states import (
    TASK_TERMINAL,
    TASK_UNFINISHED,
    GroupCondition,
    GroupOutcome,
    GroupState,
    MailboxMode,
    RunState,
    TaskState,
    Verdict,
)
from coordination.models import Event, GroupMember, Mailbox, Run, Task, TaskGroup
from coordination.models.groups import MAX_MEMBERS
from coordination.plumbing.tracing import NO_TRACE, TraceContext, span
from coordination.services import dispatch, sql, task_transitions
from coordination.services.cascade import END_EVENT_DATA_SQL, SubtreeEnd, cascade_step
from coordination.services.events import (
    EVENT_COLUMNS,
    TXID_SQL,
    event_for,
    event_insert_sql,
    event_row,
    events_record_many,
)
from coordination.services.locking import (
    LockMode,
    chain_refusal,
    fair_gate_sql,
    run_ancestors_lock,
    run_chain_lock,
    run_path_lock,
)
from coordination.services.retry import GroupDue, retrying
from coordination.services.runs import run_create, run_end
from coordination.services.task_insert import task_insert


@dataclass
class LockedGroup:
    """A group row locked ``FOR UPDATE`` together with its gate chain (root first)."""

    group: TaskGroup
    chain: list[Run]

    @property
    def gate(self) -> Run:
        """Return the gate run."""
        return self.chain[-1]


# The gate FOR UPDATE (behind its exclusive fair-gate lock, a one-time filter taken before
# the row's), then the group FOR UPDATE, in one statement, on PostgreSQL. The CTE's row lock
# is taken when the join first reads the gate, so before the outer lock on the group row,
# whatever the join order (house order: gate, then group). Both rows come back as they are
# once locked, and the group's mailbox (not locked) with them.
GATE_AND_GROUP_LOCK_SQL = f"""
WITH gate AS (
    SELECT {sql.columns(Run, "r")} FROM coordination_run r
    WHERE r.id = %(gate_id)s AND {fair_gate_sql("ARRAY[%(gate_id)s::uuid]", exclusive=True)}
    FOR UPDATE
)
SELECT {sql.columns(TaskGroup, "g")}, {sql.columns(Mailbox, "m")}, gate.*
FROM coordination_taskgroup g
JOIN gate ON gate.id = g.scope_id
JOIN coordination_mailbox m ON m.id = g.mailbox_id
WHERE g.id = %(group_id)s
FOR UPDATE OF g
"""


def _group_lock_fast(group_id: uuid.UUID, project_id: uuid.UUID | None) -> LockedGroup:
    """``group_lock`` in two or three statements: the gate's path, its ancestors, then gate and group."""
    head = sql.fetch(
        "SELECT g.scope_id, r.path FROM coordination_taskgroup g JOIN coordination_run r ON r.id = g.scope_id "
        "WHERE g.id = %(group_id)s AND (%(project_id)s::uuid IS NULL OR g.project_id = %(project_id)s::uuid)",
        {"group_id": group_id, "project_id": project_id},
    )
    if not head:
        raise exceptions.NotFound("Group not found.", groupId=str(group_id))
    gate_id, path = head[0]
    ancestors = run_ancestors_lock(path)
    rows = sql.fetch(GATE_AND_GROUP_LOCK_SQL, {"gate_id": gate_id, "group_id": group_id})
    group, mailbox, gate = sql.build_row(rows[0], TaskGroup, Mailbox, Run)
    group.mailbox, group.scope = mailbox, gate
    return LockedGroup(group, [*ancestors, gate])


def group_lock(*, group_id: uuid.UUID, project_id: uuid.UUID | None = None) -> LockedGroup:
    """Lock the gate chain, then the group; raise ``NotFound`` if there is no such group."""
    if not connection.in_atomic_block:
        raise RuntimeError("group_lock must be called inside transaction.atomic()")
    if sql.fast_paths_enabled():
        return _group_lock_fast(group_id, project_id)
    rows = TaskGroup.objects.filter(id=group_id)
    if project_id is not None:
        rows = rows.filter(project_id=project_id)
    row = rows.values_list("scope_id", "project_id").first()
    if row is None:
        raise exceptions.NotFound("Group not found.", groupId=str(group_id))
    gate_id, group_project_id = row
    chain = run_chain_lock(gate_id, project_id=group_project_id, target_mode=LockMode.UPDATE)
    # The gate chain is ours: no other decider of this group can be between its reads and ours.
    group = TaskGroup.objects.select_for_update(of=("self",)).select_related("mailbox").get(id=group_id)
    return LockedGroup(group, chain)


def _gate_problem(locked: LockedGroup, now: datetime) -> str | None:
    """Return why the group must fail regardless of its members: "cancelled", "deadline" or None."""
    refusal = chain_refusal(locked.chain, now)
    if isinstance(refusal, exceptions.ScopeCancelled | exceptions.ScopeCompleted):
        return "cancelled"
    if isinstance(refusal, exceptions.DeadlineExceeded):
        return "deadline"
    group = locked.group
    if group.deadline is not None and group.deadline <= now:
        return "deadline"
    return None


def _is_due(locked: LockedGroup, now: datetime) -> bool:
    return locked.group.state != GroupState.FINALIZED and _gate_problem(locked, now) is not None


# ``GroupCounts`` field -> ``TaskGroup`` column.
COUNT_COLUMNS = {
    "members": "member_count",
    "accepted": "accepted_count",
    "rejected": "rejected_count",
    "acceptable": "acceptable_count",
    "finished": "finished_count",
}


def group_counts(group: TaskGroup) -> GroupCounts:
    """Return the counters of ``group`` as its instance holds them."""
    return GroupCounts(**{name: getattr(group, column) for name, column in COUNT_COLUMNS.items()})


def _counts_read(group: TaskGroup) -> GroupCounts:
    """Read the locked group's counters afresh (a trigger may have moved them since the lock) onto ``group``."""
    values = TaskGroup.objects.filter(id=group.id).values_list(*COUNT_COLUMNS.values()).get()
    for column, value in zip(COUNT_COLUMNS.values(), values, strict=True):
        setattr(group, column, value)
    return group_counts(group)


def _counts_add(group: TaskGroup, delta: GroupCounts) -> None:
    """Add ``delta`` to the locked group's counters, in one statement (and to the instance)."""
    changes = {column: amount for column, amount in zip(COUNT_COLUMNS.values(), delta.astuple(), strict=True) if amount}
    if not changes:
        return
    TaskGroup.objects.filter(id=group.id).update(**{column: F(column) + amount for column, amount in changes.items()})
    for column, amount in changes.items():
        setattr(group, column, getattr(group, column) + amount)


def _event(group: TaskGroup, type: str, gate: Run, subject_id: object = None, **data) -> Event:
    return event_row(
        project_id=group.project_id,
        type=type,
        run_id=gate.id,
        run_path=gate.path,
        subject_id=subject_id or group.id,
        data=data,
    )


def group_evaluate(locked: LockedGroup, now: datetime | None = None) -> bool:
    """Apply the condition table to a locked group's counters and finalize it if decided; return whether it was.

    The counters are read here, under the group lock: every change of a member's facts
    (verdict, member insert, the task trigger) has written them before, in this
    transaction or in one that committed before the lock was granted.
    """
    group = locked.group
    if group.state == GroupState.FINALIZED:
        return False
    now = now or timezone.now()
    problem = _gate_problem(locked, now)
    if problem == "cancelled":
        _finalize(locked, GroupOutcome.FAILURE, "cancelled", now)
        return True
    decision = decide(
        condition=group.condition,
        threshold=group.threshold,
        closed=group.state == GroupState.SEALED,
        counts=_counts_read(group),
        deadline_passed=problem == "deadline",
    )
    if decision is None:
        return False
    _finalize(locked, *decision, now)
    return True


def _finalize(locked: LockedGroup, outcome: GroupOutcome, reason: str, now: datetime) -> None:
    """Record the decision, cancel the gate and every unfinished member: one transaction (one span)."""
    group = locked.group
    with span("finalize group", group_id=group.id, run_id=locked.gate.id, outcome=outcome, reason=reason):
        _finalize_in_span(locked, outcome, reason, now)


def _finalize_in_span(locked: LockedGroup, outcome: GroupOutcome, reason: str, now: datetime) -> None:
    group, gate = locked.group, locked.gate
    group.state = GroupState.FINALIZED
    group.outcome = outcome
    group.outcome_reason = reason
    group.finalized_at = now
    group.closed_at = group.closed_at or now
    if sql.fast_paths_enabled():
        # The row and its event in one statement: the group lock is held until commit.
        with connection.cursor() as cursor:
            cursor.execute(
                FINALIZE_SQL,
                {
                    "group_id": group.id,
                    "project_id": group.project_id,
                    "outcome": outcome,
                    "reason": reason,
                    "now": now,
                    "closed_at": group.closed_at,
                    "gate_id": gate.id,
                    "gate_path": gate.path,
                },
            )
    else:
        group.save(update_fields=["state", "outcome", "outcome_reason", "finalized_at", "closed_at"])
        events_record_many([_event(group, "group.finalized", gate, outcome=outcome, reason=reason)])
    if gate.stored_state == RunState.ACTIVE:
        # The gate's cascade cancels the unfinished members delivered on it; its chain is ours already.
        run_end(
            run_id=gate.id,
            project_id=group.project_id,
            state=RunState.CANCELLED,
            reason=f"group_{reason}",
            locked_chain=locked.chain,
        )
    # Members joined from elsewhere live on other runs: cancel them too.
    _cancel_unfinished_members(group_id=group.id, reason=f"group_{reason}", now=now)


# A finalizing group's unfinished members, wherever they live, in one statement: locked in id
# order (the lock order among task rows), cancelled, and their events written by the same
# data-modifying CTE (``subtree_rows_end`` does the same for a subtree).
CANCEL_GROUP_MEMBERS_SQL = f"""
WITH was AS MATERIALIZED (
    SELECT id, {task_transitions.HELD_COLUMNS} FROM coordination_task
    WHERE group_id = %(group_id)s AND state IN {task_transitions.UNFINISHED_SQL}
    ORDER BY id FOR UPDATE
), ended AS (
    UPDATE coordination_task AS t
    SET {task_transitions.CANCEL_SET_SQL}
    WHERE t.id = ANY(ARRAY(SELECT id FROM was))
    RETURNING t.id, t.project_id, t.run_id, t.run_path
)
{
    event_insert_sql(
        "ended JOIN was USING (id)",
        type_sql="'task.cancelled'",
        data_sql=f"{END_EVENT_DATA_SQL} || {task_transitions.held_event_data_sql('was')}",
    )
}
"""


def _cancel_unfinished_members(*, group_id: uuid.UUID, reason: str, now: datetime) -> None:
    """Cancel a finalizing group's unfinished members wherever they live (group already locked)."""
    if sql.fast_paths_enabled():
        with connection.cursor() as cursor:
            params = {"group_id": group_id, "reason": reason, "cause": "group_finalized", "now": now}
            cursor.execute(CANCEL_GROUP_MEMBERS_SQL, params)
        return
    members = list(Task.objects.filter(group_id=group_id, state__in=TASK_UNFINISHED).order_by("id").select_for_update())
    if not members:
        return
    task_transitions.cancel_many([t.id for t in members], now=now, reason=reason)
    events_record_many(
        [
            event_for(
                task, "task.cancelled", reason=reason, cause="group_finalized", **task_transitions.held_event_data(task)
            )
            for task in members
        ]
    )


# A group's decision and its ``group.finalized`` event, one statement (the careful path's
# ``save`` and event, folded). The data matches ``_event(..., outcome=, reason=)``.
FINALIZE_SQL = f"""
WITH done AS (
    UPDATE coordination_taskgroup
    SET state = {sql.literal(GroupState.FINALIZED)}, outcome = %(outcome)s, outcome_reason = %(reason)s,
        finalized_at = %(now)s, closed_at = %(closed_at)s
    WHERE id = %(group_id)s
    RETURNING id
)
INSERT INTO coordination_event ({EVENT_COLUMNS})
SELECT {TXID_SQL}, %(project_id)s, 'group.finalized', %(gate_id)s, %(gate_path)s, done.id::text,
    jsonb_build_object('outcome', %(outcome)s::text, 'reason', %(reason)s::text), %(now)s
FROM done
"""


def _close(locked: LockedGroup, now: datetime) -> None:
    group = locked.group
    group.state = GroupState.SEALED
    group.closed_at = now
    group.save(update_fields=["state", "closed_at"])
    events_record_many([_event(group, "group.closed", locked.gate)])


def _add_member(locked: LockedGroup, task: Task, now: datetime) -> None:
    group = locked.group
    GroupMember.objects.create(group=group, task=task, joined_at=now)
    # The task is locked (or new): its facts hold until commit, and from then on the trigger follows them.
    _counts_add(group, member_counts(MemberFacts(task.state, None)))
    if group.expected_members is not None and group.member_count >= group.expected_members:
        _close(locked, now)


# Create ----------------------------------------------------------------------------------


def _validate_create(condition, threshold, expected_members, deadline, now) -> None:
    errors = {}
    if condition not in GroupCondition.values:
        errors["condition"] = "FIRST_ACCEPTED, N_ACCEPTED or ALL_TERMINAL"
    elif condition == GroupCondition.N_ACCEPTED:
        if threshold is None or not 1 <= threshold <= MAX_MEMBERS:
            errors["threshold"] = f"required for N_ACCEPTED, between 1 and {MAX_MEMBERS}"
    elif threshold is not None:
        errors["threshold"] = "only for N_ACCEPTED"
    if expected_members is not None:
        if not 1 <= expected_members <= MAX_MEMBERS:
            errors["expectedMembers"] = f"between 1 and {MAX_MEMBERS}"
        elif threshold is not None and expected_members < threshold:
            errors["expectedMembers"] = "must be at least threshold"
    if deadline is not None and deadline <= now:
        errors["deadline"] = "must be in the future"
    if errors:
        raise exceptions.ValidationFailed("Invalid group.", **errors)


@transaction.atomic
def group_create(
    *,
    project_id: uuid.UUID,
    mailbox_name: str,
    condition: str,
    threshold: int | None = None,
    expected_members: int | None = None,
    deadline: datetime | None = None,
    parent_scope_id: uuid.UUID | None = None,
    name: str = "",
) -> TaskGroup:
    """Create a group and its gate run (a child of ``parent_scope_id`` when given)."""
    now = timezone.now()
    _validate_create(condition, threshold, expected_members, deadline, now)
    mailbox = Mailbox.objects.filter(project_id=project_id, name=mailbox_name, mode=MailboxMode.WORK).first()
    if mailbox is None:
        raise exceptions.NotFound("No WORK mailbox with that name.", mailbox=mailbox_name)
    # Creating the gate is new work under the parent: refused when the parent is inactive.
    gate = run_create(project_id=project_id, parent_id=parent_scope_id, name=f"group {name}".strip(), deadline=deadline)
    group = TaskGroup.objects.create(
        project_id=project_id,
        mailbox=mailbox,
        scope=gate,
        parent_scope_id=parent_scope_id,
        name=name,
        condition=condition,
        threshold=threshold,
        expected_members=expected_members,
        deadline=deadline,
        created_at=now,
    )
    events_record_many(
        [_event(group, "group.created", gate, condition=condition, threshold=threshold, mailbox=mailbox_name)]
    )
    return group


# Members ---------------------------------------------------------------------------------


@retrying
@transaction.atomic
def group_submit(
    *,
    project_id: uuid.UUID,
    group_id: uuid.UUID,
    input: object,
    key: str | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    expires_at: datetime | None = None,
    trace: TraceContext = NO_TRACE,
) -> tuple[Task, bool, TaskGroup]:
    """Submit a new member on the gate; return it, whether it was created, and the group.

    ``trace`` is the submitter's W3C context, stored on the task. The same key and input
    answer the existing member, even after close. The submit that reaches ``expectedMembers``
    closes the group in this transaction.
    """
    locked = group_lock(group_id=group_id, project_id=project_id)
    group, gate = locked.group, locked.gate
    if key is not None:
        existing = Task.objects.filter(mailbox=group.mailbox, run_id=gate.id, key=key).first()
        if existing is not None:
            if existing.input != input:
                raise exceptions.KeyConflict(key=key, taskId=str(existing.id))
            dispatch.work_resubmitted(existing)
            return existing, False, group
    now = timezone.now()
    if _is_due(locked, now):
        raise GroupDue(group.id, finalize=group_finalize_if_due)
    if group.state != GroupState.OPEN:
        raise exceptions.GroupClosed(groupId=str(group.id), state=group.state)
    if group.member_count >= MAX_MEMBERS:
        raise exceptions.GroupFull(groupId=str(group.id), maxMembers=MAX_MEMBERS)
    task = task_insert(
        project_id=project_id,
        mailbox=group.mailbox,
        chain=locked.chain,
        input=input,
        key=key,
        priority=priority,
        max_attempts=max_attempts,
        expires_at=expires_at,
        group=group,
        now=now,
        trace=trace,
    )
    _add_member(locked, task, now)
    group_evaluate(locked, now)
    return task, True, group


@retrying
@transaction.atomic
def group_join(*, project_id: uuid.UUID, group_id: uuid.UUID, task_id: uuid.UUID) -> tuple[Task, TaskGroup]:
    """Add an existing task of the group's mailbox while the group is open."""
    run_path = Task.objects.filter(id=task_id, project_id=project_id).values_list("run_path", flat=True).first()
    if run_path is not None:  # else NotFound, below
        joining_chain_lock(project_id=project_id, group_id=group_id, run_path=run_path)
    locked = group_lock(group_id=group_id, project_id=project_id)
    group = locked.group
    task = Task.objects.select_for_update().filter(id=task_id, project_id=project_id).first()
    if task is None:
        raise exceptions.NotFound("Task not found.", taskId=str(task_id))
    if task.group_id == group.id:
        return task, group
    if task.mailbox_id != group.mailbox_id:
        raise exceptions.ValidationFailed("The task is in another mailbox.", taskId="must be in the group's mailbox")
    if task.group_id is not None:
        raise exceptions.InvalidState("The task is in another group.", taskId=str(task.id))
    now = timezone.now()
    if _is_due(locked, now):
        raise GroupDue(group.id, finalize=group_finalize_if_due)
    if group.state != GroupState.OPEN:
        raise exceptions.GroupClosed(groupId=str(group.id), state=group.state)
    if group.member_count >= MAX_MEMBERS:
        raise exceptions.GroupFull(groupId=str(group.id), maxMembers=MAX_MEMBERS)
    task.group = group
    task.save(update_fields=["group"])
    _add_member(locked, task, now)
    group_evaluate(locked, now)
    return task, group


def joining_chain_lock(*, project_id: uuid.UUID, group_id: uuid.UUID, run_path: str) -> None:
    """Lock the chain of a joining task's run (at ``run_path``), before the group (house order: run chain, group, task).

    A cancel or complete of a run above the task then either commits before the join locks
    (the join finds the task ended, and decides the group on it) or waits for the join to
    commit; its cascade then reads the task as a member and locks the group before ending it
    (``groups_end_subtree``). Without this lock a join could commit between the cascade's read
    of its member groups and its task step: the task ended without its group locked, so a
    decision it made went unmade, and the trigger's group update could deadlock with a
    finalize (docs/internals.md, "Group counters"). The gate, when it is in the chain, is
    locked ``FOR UPDATE`` here, as ``group_lock`` takes it: a caller that goes on to lock the
    chain for a submit (a rerun) then never upgrades a share lock on it, which deadlocks
    against another doing the same (a rerun of a member on the gate, too). Nothing is locked
    when the group is not found: the join then says so.
    """
    gate_id = TaskGroup.objects.filter(id=group_id, project_id=project_id).values_list("scope_id", flat=True).first()
    if gate_id is not None:
        run_path_lock(run_path, update=gate_id)


# Close, verdicts -------------------------------------------------------------------------


@retrying
@transaction.atomic
def group_close(*, project_id: uuid.UUID, group_id: uuid.UUID, seal: bool = False) -> TaskGroup:
    """Close the group to new members and evaluate it at once; idempotent.

    ``seal=True`` is the same, but a group already finalized is ``GROUP_FINALIZED``.
    """
    locked = group_lock(group_id=group_id, project_id=project_id)
    group = locked.group
    now = timezone.now()
    if _is_due(locked, now):
        raise GroupDue(group.id, finalize=group_finalize_if_due)
    if group.state == GroupState.FINALIZED:
        if seal:
            raise exceptions.GroupFinalized(groupId=str(group.id), outcome=group.outcome)
        return group
    if group.state == GroupState.OPEN:
        _close(locked, now)
    group_evaluate(locked, now)
    return group


@dataclass(frozen=True)
class VerdictResult:
    """A recorded verdict and the group's state after it."""

    member: GroupMember
    group: TaskGroup


_TERMINAL_SQL = ", ".join(sql.literal(state) for state in sorted(TASK_TERMINAL))


def decides_sql(*, condition: str, threshold: str, closed: str, counts: dict[str, str]) -> str:
    """Return a SQL boolean: whether ``group_rules.decide`` decides a group with these counters, deadline aside.

    Every argument is a SQL expression; ``counts`` maps the ``GroupCounts`` fields to theirs.
    The condition table's twin for the single-statement verdict, which must know whether it
    decides before it writes; ``tests/coordination/test_group_rules.py`` proves the two agree
    over the whole table. An unknown condition counts as deciding (the careful path then runs).
    """
    a, s, f, n = counts["accepted"], counts["acceptable"], counts["finished"], counts["members"]
    return (
        f"coalesce(CASE {condition}"
        f" WHEN {sql.literal(GroupCondition.FIRST_ACCEPTED)} THEN {a} >= 1"
        f" WHEN {sql.literal(GroupCondition.N_ACCEPTED)} THEN {a} >= {threshold}"
        f" OR ({closed} AND {a} + {s} < {threshold})"
        f" WHEN {sql.literal(GroupCondition.ALL_TERMINAL)} THEN {closed} AND {f} = {n}"
        " END, true)"
    )


def verdict_delta(task_state: str, verdict: str) -> GroupCounts:
    """Return what a first verdict on a member whose task is in ``task_state`` adds to the counters."""
    return member_counts(MemberFacts(task_state, verdict)) - member_counts(MemberFacts(task_state, None))


def _verdict_delta_sql(field: str) -> str:
    """Return SQL for ``verdict_delta(task.state, %(verdict)s)``'s ``field``, built from the Python table."""
    cases = []
    for verdict in Verdict:
        by_amount: dict[int, list[str]] = {}
        for state in TaskState:
            if amount := getattr(verdict_delta(state, verdict), field):
                by_amount.setdefault(amount, []).append(state)
        cases += [
            f"WHEN %(verdict)s = {sql.literal(verdict)} AND task.state IN {sql.in_list(states)} THEN {amount}"
            for amount, states in sorted(by_amount.items())
        ]
    return f"CASE {' '.join(cases)} ELSE 0 END" if cases else "0"


_COUNTS_AFTER = {name: f"(grp.{column} + delta.{name})" for name, column in COUNT_COLUMNS.items()}

# A verdict in one statement, run in autocommit, so that the commit (and its WAL flush) ends
# the statement on the server with no round trip under the gate lock. It takes the locks of
# ``group_lock`` in the house order: the gate's ancestors FOR KEY SHARE behind their shared
# fair-gate locks, then the gate's exclusive fair-gate lock and the gate FOR UPDATE (each a
# one-time filter evaluated before its scan; the CASE orders the gate's after the
# ancestors'), the group FOR UPDATE (its join reads the gate first), then the member's task
# FOR UPDATE. Locked rows come back as they are once locked (READ COMMITTED follows their
# updates), so the group's counters and the task's state are the committed ones even when
# the statement's snapshot is older than the lock. It records the verdict (``late`` when the
# group is FINALIZED), its event and the new counters, unless the new counters decide the
# group (the same table as ``group_rules.decide``, ``decides_sql``), the gate chain is
# inactive or a deadline passed, the member is unknown or judged, or its task's state does
# not allow the verdict: then it writes nothing and returns no row, and the careful
# transaction (``_verdict_careful``) decides the answer, finalizing in one transaction.
# That transaction, once it holds the group lock, runs the same statement with
# ``may_decide`` (the deciding test off) and evaluates the group before its commit, so a
# deciding verdict, and the verdicts that queued behind it and arrive late, are recorded
# there by this one statement too.
FAST_VERDICT_SQL = f"""
WITH head AS MATERIALIZED (
    SELECT g.scope_id AS gate_id, string_to_array(rtrim(r.path, '/'), '/')::uuid[] AS ids
    FROM coordination_taskgroup g JOIN coordination_run r ON r.id = g.scope_id
    WHERE g.id = %(group_id)s AND g.project_id = %(project_id)s
), ancestors AS MATERIALIZED (
    SELECT a.stored_state, a.deadline FROM coordination_run a
    WHERE a.id = ANY ((SELECT ids[1:cardinality(ids) - 1] FROM head)::uuid[])
      AND (SELECT {fair_gate_sql("head.ids[1:cardinality(head.ids) - 1]")} FROM head)
    ORDER BY a.depth
    FOR KEY SHARE OF a
), gate AS MATERIALIZED (
    SELECT r.id, r.path, r.stored_state, r.deadline FROM coordination_run r
    WHERE r.id = (SELECT gate_id FROM head)
      AND CASE WHEN (SELECT count(*) FROM ancestors) >= 0
          THEN (SELECT {fair_gate_sql("ARRAY[head.gate_id]", exclusive=True)} FROM head) END
    FOR UPDATE OF r
), grp AS MATERIALIZED (
    SELECT g.*, gate.path AS gate_path, gate.stored_state AS gate_state, gate.deadline AS gate_deadline
    FROM coordination_taskgroup g JOIN gate ON gate.id = g.scope_id
    WHERE g.id = %(group_id)s
    FOR UPDATE OF g
), task AS MATERIALIZED (
    SELECT t.id, t.state FROM coordination_task t JOIN grp ON t.group_id = grp.id
    WHERE t.id = %(task_id)s
    FOR UPDATE OF t
), delta AS MATERIALIZED (
    SELECT {", ".join(f"{_verdict_delta_sql(name)} AS {name}" for name in COUNT_COLUMNS)} FROM task
), judged AS (
    UPDATE coordination_groupmember m
    SET verdict = %(verdict)s, verdict_at = %(now)s, late = (grp.state = {sql.literal(GroupState.FINALIZED)})
    FROM task, grp, delta
    WHERE m.task_id = task.id AND m.group_id = grp.id AND m.verdict IS NULL
      AND CASE %(verdict)s
          WHEN {sql.literal(Verdict.ACCEPTED)} THEN task.state = {sql.literal(TaskState.SUCCEEDED)}
          WHEN {sql.literal(Verdict.REJECTED)} THEN task.state IN ({_TERMINAL_SQL})
          ELSE false END
      AND (grp.state = {sql.literal(GroupState.FINALIZED)} OR (
          (SELECT coalesce(bool_and(stored_state = {sql.literal(RunState.ACTIVE)}
                AND (deadline IS NULL OR deadline > %(now)s)), true) FROM ancestors)
          AND grp.gate_state = {sql.literal(RunState.ACTIVE)}
          AND (grp.gate_deadline IS NULL OR grp.gate_deadline > %(now)s)
          AND (grp.deadline IS NULL OR grp.deadline > %(now)s)
          AND (%(may_decide)s OR NOT {
    decides_sql(
        condition="grp.condition",
        threshold="grp.threshold",
        closed=f"grp.state = {sql.literal(GroupState.SEALED)}",
        counts=_COUNTS_AFTER,
    )
})))
    RETURNING m.*
), counted AS (
    UPDATE coordination_taskgroup g
    SET {", ".join(f"{column} = {_COUNTS_AFTER[name]}" for name, column in COUNT_COLUMNS.items() if name != "members")}
    FROM judged, grp, delta
    WHERE g.id = judged.group_id AND grp.id = g.id
    RETURNING {sql.columns(TaskGroup, "g")}
), events AS (
    INSERT INTO coordination_event ({EVENT_COLUMNS})
    SELECT {TXID_SQL}, grp.project_id, 'member.verdict', grp.scope_id, grp.gate_path, judged.task_id::text,
        jsonb_build_object('groupId', judged.group_id::text, 'verdict', judged.verdict, 'late', judged.late), %(now)s
    FROM judged, grp
)
SELECT {sql.columns(GroupMember, "judged")}, {sql.columns(TaskGroup, "counted")}
FROM judged, counted
"""


def _verdict_fast(
    project_id: uuid.UUID,
    group_id: uuid.UUID,
    task_id: uuid.UUID,
    verdict: Verdict,
    *,
    now: datetime | None = None,
    may_decide: bool = False,
):
    """Record a verdict in one statement; None when it wrote nothing.

    Alone (autocommit), only a verdict that does not decide. With ``may_decide``, inside
    the careful transaction that holds the group lock already, a deciding one too: the
    caller then evaluates the group in that transaction.
    """
    params = {
        "project_id": project_id,
        "group_id": group_id,
        "task_id": task_id,
        "verdict": verdict,
        "now": now or timezone.now(),
        "may_decide": may_decide,
    }
    rows = sql.fetch(FAST_VERDICT_SQL, params)
    if not rows:
        return None
    member, group = sql.build_row(rows[0], GroupMember, TaskGroup)
    return VerdictResult(member, group)


@retrying
def group_verdict(*, project_id: uuid.UUID, group_id: uuid.UUID, task_id: uuid.UUID, verdict: Verdict) -> VerdictResult:
    """Accept or reject a member; idempotent. After finalize the verdict is kept as ``late``.

    On PostgreSQL a verdict that does not decide its group is one statement in autocommit
    (``FAST_VERDICT_SQL``): the gate lock is held for that statement and its commit only.
    A verdict that decides, and everything unusual, takes the careful transaction.
    """
    if sql.fast_paths_enabled():
        result = _verdict_fast(project_id, group_id, task_id, verdict)
        if result is not None:
            return result
    return _verdict_careful(project_id=project_id, group_id=group_id, task_id=task_id, verdict=verdict)


@transaction.atomic
def _verdict_careful(
    *, project_id: uuid.UUID, group_id: uuid.UUID, task_id: uuid.UUID, verdict: Verdict
) -> VerdictResult:
    """Record the verdict in one transaction: lock, record, count, evaluate (finalize and cancel when decided)."""
    locked = group_lock(group_id=group_id, project_id=project_id)
    group = locked.group
    if sql.fast_paths_enabled():
        # The lock is ours: the same statement records even a deciding verdict (its locks
        # are taken again at once), and the group is evaluated before the commit. The
        # verdicts that queued behind a deciding one also come here, to record late.
        now = timezone.now()
        if not _is_due(locked, now):
            result = _verdict_fast(project_id, group_id, task_id, verdict, now=now, may_decide=True)
            if result is not None:
                if not result.member.late:
                    group_evaluate(locked, now)
                return VerdictResult(result.member, group)
    member = GroupMember.objects.filter(group=group, task_id=task_id).first()
    if member is None:
        raise exceptions.NotFound("No such member.", taskId=str(task_id))
    # Group before task (house order); the task's state must not move while we judge it.
    task = Task.objects.select_for_update().get(id=task_id)
    now = timezone.now()
    # A group past its deadline is decided before this verdict, which then arrives late.
    if _is_due(locked, now):
        group_evaluate(locked, now)
    if member.verdict == verdict:
        return VerdictResult(member, group)
    if member.verdict is not None:
        raise exceptions.VerdictConflict(taskId=str(task_id), verdict=member.verdict)
    if verdict == Verdict.ACCEPTED and task.state != TaskState.SUCCEEDED:
        raise exceptions.TaskNotSucceeded(taskId=str(task_id), state=task.state)
    if verdict == Verdict.REJECTED and task.state not in TASK_TERMINAL:
        raise exceptions.TaskNotFinished(taskId=str(task_id), state=task.state)
    member.verdict = verdict
    member.verdict_at = now
    member.late = group.state == GroupState.FINALIZED
    member.save(update_fields=["verdict", "verdict_at", "late"])
    _counts_add(group, verdict_delta(task.state, verdict))
    events_record_many(
        [
            _event(
                group,
                "member.verdict",
                locked.gate,
                subject_id=task_id,
                groupId=str(group.id),
                verdict=verdict,
                late=member.late,
            )
        ]
    )
    if not member.late:
        group_evaluate(locked, now)
    return VerdictResult(member, group)


# Reads and the deadline ------------------------------------------------------------------


@transaction.atomic
def group_finalize_if_due(*, group_id: uuid.UUID) -> TaskGroup:
    """Finalize the group if its deadline passed or its gate is inactive; return it."""
    locked = group_lock(group_id=group_id)
    group_evaluate(locked)
    return locked.group


def groups_finalize_due(*, now: datetime | None = None, batch_size: int = 100) -> int:
    """Finalize undecided groups past their deadline, one short transaction each; return how many."""
    now = now or timezone.now()
    due = list(
        TaskGroup.objects.exclude(state=GroupState.FINALIZED)
        .filter(deadline__lte=now)
        .order_by("deadline")
        .values_list("id", flat=True)[:batch_size]
    )
    for group_id in due:
        group_finalize_if_due(group_id=group_id)
    return len(due)


# Run cascade -----------------------------------------------------------------------------


@cascade_step
def groups_end_subtree(end: SubtreeEnd) -> None:
    """Finalize groups gated in the subtree (``FAILURE``/``cancelled``); lock groups of members in it.

    Runs before the tasks step: groups are locked before tasks (house order).
    """
    prefix = end.path_prefix
    gated = list(
        TaskGroup.objects.filter(scope__path__startswith=prefix)
        .exclude(state=GroupState.FINALIZED)
        .order_by("id")
        .values_list("id", flat=True)
    )
    for group_id in gated:
        group_evaluate(group_lock(group_id=group_id))
    member_groups = sorted(
        set(
            Task.objects.filter(run_path__startswith=prefix, state__in=TASK_UNFINISHED, group__isnull=False)
            .exclude(group__state=GroupState.FINALIZED)
            .values_list("group_id", flat=True)
        )
        - set(gated)
    )
    end.memo["member_groups"] = [group_lock(group_id=group_id) for group_id in member_groups]


@cascade_step
def groups_reevaluate_after_subtree_end(end: SubtreeEnd) -> None:
    """Evaluate the groups whose members the cascade just cancelled."""
    for locked in end.memo.get("member_groups", []):
        group_evaluate(locked, end.now)
