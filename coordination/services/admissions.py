"""Admissions: at most ``maxActive`` child runs of a run at once, first come first served.

The only writer of ``Admission.state`` and of ``AdmissionConfig``'s counters.

Lock order (house rule): the run chain (root first), then the parent's ``AdmissionConfig``
row, then waiter rows. Every path that may create a child run locks the parent
``FOR NO KEY UPDATE`` (as ``run_create`` does) *before* the config row: taking it after, while
another request holds the parent and waits for the config, would deadlock.
"""

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Q, Sum
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.ids import path_ids
from coordination.domain.states import AdmissionState
from coordination.models import Admission, AdmissionConfig, Event, Run
from coordination.models.runs import MAX_DEPTH
from coordination.services.cascade import SubtreeEnd, cascade_step
from coordination.services.events import event_row, events_record_many
from coordination.services.locking import LockMode, chain_refusal, run_chain_lock
from coordination.services.runs import run_create

MAX_ACTIVE = 1_000_000
MAX_KEY_LENGTH = 200

_CODE_ERRORS = {
    cls.code: cls
    for cls in (
        exceptions.ScopeCancelled,
        exceptions.ScopeCompleted,
        exceptions.DeadlineExceeded,
        exceptions.ChildLimitReached,
        exceptions.InvalidState,
    )
}


def _event(admission: Admission, type: str, **data) -> Event:
    # Admission events belong to the parent run: that is where a reader of the run looks.
    return event_row(
        project_id=admission.project_id,
        type=type,
        run_id=admission.parent_id,
        run_path=admission.parent_path,
        subject_id=admission.id,
        data={"key": admission.key, "name": admission.name, **data},
    )


def admission_refusal(admission: Admission) -> exceptions.Conflict | None:
    """Return the error a cancelled admission answers its waiter with, or None."""
    if admission.state != AdmissionState.CANCELLED:
        return None
    error = _CODE_ERRORS.get(admission.end_code or "", exceptions.ScopeCancelled)
    return error(runId=str(admission.end_run_id or admission.parent_id), admissionId=str(admission.id))


def _lock_parent(parent_id: uuid.UUID, project_id: uuid.UUID) -> list[Run]:
    # FOR NO KEY UPDATE on the parent, like run_create (called below for an admitted
    # request, re-taking the locks we hold): only one transaction at a time may create
    # children of this parent, and a cancel of the chain waits for us (or refuses us).
    return run_chain_lock(parent_id, project_id=project_id, target_mode=LockMode.NO_KEY_UPDATE)


def _config_lock(parent: Run, *, create: bool) -> AdmissionConfig | None:
    # Under the parent's NO KEY UPDATE no other admission path of this parent runs, so a
    # config row missing here cannot be created concurrently: get-or-create needs no retry.
    config = AdmissionConfig.objects.select_for_update().filter(run_id=parent.id).first()
    if config is None and create:
        config = AdmissionConfig.objects.create(project_id=parent.project_id, run=parent, run_path=parent.path)
    return config


def _has_room(config: AdmissionConfig) -> bool:
    return config.max_active is None or config.admitted < config.max_active


def _create_child(admission: Admission, now: datetime) -> None:
    """Create the admission's child run and mark it admitted (the config row is locked)."""
    run = run_create(
        project_id=admission.project_id, parent_id=admission.parent_id, name=admission.name, deadline=admission.deadline
    )
    admission.run = run
    admission.run_path = run.path
    admission.state = AdmissionState.ADMITTED
    admission.holds_slot = True
    admission.admitted_at = now


def _admit_waiters(config: AdmissionConfig, chain: list[Run], now: datetime) -> None:
    """Admit the head of the line while there is room; the parent chain and config row are locked.

    Called by every change that may make room: a child's end, a raised ``maxActive``.
    Waiters are locked one at a time in ticket order (the lock order among them).
    """
    if config.waiting == 0 or chain_refusal(chain, now) is not None:
        return  # an inactive parent's waiters are answered by its own end (or at read time)
    events = []
    changed = False
    while config.waiting > 0 and _has_room(config):
        # The config row lock serializes every writer of this line, so the head read here
        # stays the head until we commit.
        head = (
            Admission.objects.select_for_update()
            .filter(config=config, state=AdmissionState.WAITING)
            .order_by("ticket")
            .first()
        )
        if head is None:  # pragma: no cover - the counter says someone waits
            config.waiting = 0
            break
        config.waiting -= 1
        changed = True
        refusal = _child_refusal(head, chain[-1], now)
        if refusal is None:
            try:
                # run_create is atomic (a savepoint): a refusal undoes only its own writes.
                _create_child(head, now)
            except exceptions.CoordinationError as error:
                refusal = _as_refusal(error, chain[-1])
        if refusal is not None:
            # The end or raise that got here must still commit: this waiter is answered instead.
            _cancel(head, refusal, now, events)
            continue
        chain[-1].child_count += 1  # run_create counted it in the row; keep our copy in step
        config.admitted += 1
        head.save(update_fields=["run", "run_path", "state", "holds_slot", "admitted_at"])
        events.append(_event(head, "admission.admitted", runId=str(head.run_id), waited=True))
    if changed:
        config.updated_at = now
        config.save(update_fields=["waiting", "admitted", "updated_at"])
    events_record_many(events)


def _child_refusal(admission: Admission, parent: Run, now: datetime) -> exceptions.Conflict | None:
    """Return why a waiter's child run can no longer be created, or None."""
    if parent.child_count >= parent.child_limit:
        # childLimit counts every child ever created, so this head would wait forever.
        return exceptions.ChildLimitReached(runId=str(parent.id), childLimit=parent.child_limit)
    if admission.deadline is not None and admission.deadline <= now:
        return exceptions.DeadlineExceeded(runId=str(parent.id), deadline=admission.deadline.isoformat())
    return None


def _as_refusal(error: exceptions.CoordinationError, parent: Run) -> exceptions.Conflict:
    """Return the code a waiter answers when its run could not be created for ``error``."""
    if isinstance(error, exceptions.Conflict):
        return error
    if "deadline" in error.details:
        return exceptions.DeadlineExceeded(runId=str(parent.id), deadline=error.details["deadline"])
    return exceptions.InvalidState(error.message, runId=str(parent.id))


def _cancel(admission: Admission, refusal: exceptions.Conflict, now: datetime, events: list[Event]) -> None:
    admission.state = AdmissionState.CANCELLED
    admission.end_code = refusal.code
    admission.end_run_id = refusal.details.get("runId")
    admission.ended_at = now
    admission.save(update_fields=["state", "end_code", "end_run_id", "ended_at"])
    events.append(_event(admission, "admission.cancelled", code=refusal.code))


@dataclass(frozen=True)
class AdmissionAnswer:
    """An admission and whether this call created its child run (201) or found it (200)."""

    admission: Admission
    admitted_now: bool


@transaction.atomic
def admission_configure(*, project_id: uuid.UUID, run_id: uuid.UUID, max_active: int) -> tuple[AdmissionConfig, bool]:
    """Set how many admitted children of the run may be active at once; return (config, created).

    ``created`` is true when the run had no limit before. Raising the limit admits the
    waiters that now fit, in this transaction; lowering it revokes nobody.
    """
    if not 0 <= max_active <= MAX_ACTIVE:
        raise exceptions.ValidationFailed("Invalid maxActive.", maxActive=f"between 0 and {MAX_ACTIVE}")
    chain = _lock_parent(run_id, project_id)
    refusal = chain_refusal(chain)
    if refusal is not None:
        raise refusal
    config = _config_lock(chain[-1], create=True)
    created = config.max_active is None
    now = timezone.now()
    config.max_active = max_active
    config.updated_at = now
    config.save(update_fields=["max_active", "updated_at"])
    _admit_waiters(config, chain, now)
    return config, created


@transaction.atomic
def admission_request(
    *,
    project_id: uuid.UUID,
    run_id: uuid.UUID,
    name: str = "",
    key: str | None = None,
    deadline: datetime | None = None,
) -> AdmissionAnswer:
    """Ask for a child run of ``run_id``: admitted at once when there is room and nobody waits, else queued.

    The same ``key`` answers the existing admission, whatever its state. An admitted
    request's child run is created here, by ``run_create`` (``childLimit`` and the deadline
    checks apply). Refused with the run's code under an inactive run.
    """
    if key is not None and not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise exceptions.ValidationFailed("Invalid key.", key=f"1 to {MAX_KEY_LENGTH} characters")
    if deadline is not None and deadline <= timezone.now():
        raise exceptions.ValidationFailed("Invalid admission.", deadline="must be in the future")
    chain = _lock_parent(run_id, project_id)
    parent = chain[-1]
    config = _config_lock(parent, create=True)
    now = timezone.now()  # read under the lock: admission times follow the line's order
    if key is not None:
        # The parent's lock serializes requests of this parent: a key read here stays unused
        # until we commit.
        existing = Admission.objects.filter(parent_id=parent.id, key=key).first()
        if existing is not None:
            return AdmissionAnswer(existing, admitted_now=False)
    refusal = chain_refusal(chain, now)
    if refusal is not None:
        raise refusal
    if parent.depth + 1 >= MAX_DEPTH:
        # Checked here too, not only by run_create: a waiter must be able to get its run later.
        raise exceptions.ValidationFailed(f"Runs nest at most {MAX_DEPTH} deep.", runId=str(parent.id))
    admission = Admission(
        project_id=project_id,
        config=config,
        parent=parent,
        parent_path=parent.path,
        ticket=config.next_ticket,
        key=key,
        name=name,
        deadline=deadline,
        created_at=now,
    )
    config.next_ticket += 1
    config.updated_at = now
    if config.waiting == 0 and _has_room(config):
        _create_child(admission, now)  # may raise CHILD_LIMIT_REACHED: nothing is written then
        config.admitted += 1
        admission.save(force_insert=True)
        config.save(update_fields=["next_ticket", "admitted", "updated_at"])
        events_record_many([_event(admission, "admission.admitted", runId=str(admission.run_id), waited=False)])
        return AdmissionAnswer(admission, admitted_now=True)
    admission.save(force_insert=True)
    config.waiting += 1
    config.save(update_fields=["next_ticket", "waiting", "updated_at"])
    events_record_many([_event(admission, "admission.waiting", position=config.waiting)])
    return AdmissionAnswer(admission, admitted_now=False)


@transaction.atomic
def admission_withdraw(*, project_id: uuid.UUID, admission_id: uuid.UUID) -> Admission:
    """Leave the queue (``WITHDRAWN``); ``INVALID_STATE`` once admitted; unchanged once withdrawn or cancelled.

    Allowed under an inactive run: leaving hands nothing out. The waiters behind move up
    one place; nobody is admitted, since a waiter exists only while the admitted are at the
    limit.
    """
    found = (
        Admission.objects.filter(id=admission_id, project_id=project_id).values_list("parent_id", "config_id").first()
    )
    if found is None:
        raise exceptions.NotFound("Admission not found.", admissionId=str(admission_id))
    parent_id, config_id = found  # neither ever changes
    # KEY SHARE is enough: leaving the line creates no run. A concurrent cancel of the chain
    # then either ran first (we find the admission CANCELLED) or waits for us.
    run_chain_lock(parent_id, project_id=project_id)
    # The config row before the waiter's row: the admitting paths lock in this order.
    config = AdmissionConfig.objects.select_for_update().get(id=config_id)
    admission = Admission.objects.select_for_update().get(id=admission_id)
    if admission.state == AdmissionState.ADMITTED:
        raise exceptions.InvalidState(
            "An admitted admission cannot be withdrawn.", admissionId=str(admission.id), state=admission.state
        )
    if admission.state != AdmissionState.WAITING:
        return admission
    now = timezone.now()
    admission.state = AdmissionState.WITHDRAWN
    admission.ended_at = now
    admission.save(update_fields=["state", "ended_at"])
    config.waiting -= 1
    config.updated_at = now
    config.save(update_fields=["waiting", "updated_at"])
    events_record_many([_event(admission, "admission.withdrawn")])
    return admission


def admission_position(admission: Admission) -> int | None:
    """Return a waiting admission's place in line, counting from 1; None otherwise."""
    if admission.state != AdmissionState.WAITING:
        return None
    return Admission.objects.filter(
        config_id=admission.config_id, state=AdmissionState.WAITING, ticket__lte=admission.ticket
    ).count()


# The end of a run (cancel, complete, deadline sweep) -------------------------------------


@cascade_step
def admissions_end_subtree(end: SubtreeEnd) -> None:
    """Free the slot of an admitted run that ends, and close the lines of runs that end.

    A cascade step (``cascade.cascade_steps``), inside the transaction that ends ``end.run``
    with its chain locked (ancestors ``FOR KEY SHARE``, the run ``FOR UPDATE``):

    - ``end.run`` admitted under a parent outside the subtree: the parent's next waiters are
      admitted now, in this transaction, with their runs;
    - every admission config in the subtree: its waiters are ``CANCELLED`` with the run's code
      and its admitted children stop counting (their parent refuses new work for good).
    """
    now = end.now
    own = Admission.objects.filter(run_id=end.run.id, holds_slot=True).values_list("parent_id", flat=True).first()
    if own is not None:
        # Upgrade the parent (already FOR KEY SHARE as our ancestor) to NO KEY UPDATE before
        # its config row, as every admitting path does: the next waiter's run is created below.
        chain = run_chain_lock(own, project_id=end.run.project_id, target_mode=LockMode.NO_KEY_UPDATE)
        config = _config_lock(chain[-1], create=False)
        Admission.objects.filter(run_id=end.run.id).update(holds_slot=False, released_at=now)
        config.admitted -= 1
        config.updated_at = now
        config.save(update_fields=["admitted", "updated_at"])
        # The time read under the config lock: admission times follow the line's order.
        _admit_waiters(config, chain, timezone.now())
    configs = list(
        # Served by the partial index ``admission_config_busy_path`` (migration 0012) on PostgreSQL.
        AdmissionConfig.objects.filter(run_path__startswith=end.path_prefix)
        .filter(Q(waiting__gt=0) | Q(admitted__gt=0))
        .order_by("id")
        .select_for_update()
    )
    if not configs:
        return
    code = exceptions.SUBTREE_END_CODES[end.cause]
    events: list[Event] = []
    for config in configs:
        # The config row is locked (and its parent is ending under our lock), so the line
        # read here is the whole line.
        waiters = list(
            Admission.objects.filter(config=config, state=AdmissionState.WAITING).order_by("ticket").select_for_update()
        )
        if waiters:
            Admission.objects.filter(id__in=[w.id for w in waiters]).update(
                state=AdmissionState.CANCELLED, end_code=code, end_run_id=end.run.id, ended_at=now
            )
            events.extend(
                _event(w, "admission.cancelled", code=code, cause=end.cause, reason=end.reason) for w in waiters
            )
        Admission.objects.filter(config=config, holds_slot=True).update(holds_slot=False, released_at=now)
        AdmissionConfig.objects.filter(id=config.id).update(waiting=0, admitted=0, updated_at=now)
    events_record_many(events)


def admissions_counts(*, project_id: uuid.UUID | None = None) -> dict[str, int]:
    """Return how many admissions are admitted (still active) and waiting, over one project or every project."""
    configs = AdmissionConfig.objects if project_id is None else AdmissionConfig.objects.filter(project_id=project_id)
    sums = configs.aggregate(admitted=Sum("admitted"), waiting=Sum("waiting"))
    return {"admitted": sums["admitted"] or 0, "waiting": sums["waiting"] or 0}


def admission_wait_refusal(admission: Admission) -> exceptions.Conflict | None:
    """Return the code a waiter of ``admission`` is answered with now, or None while it may still be admitted.

    A cancelled admission answers its recorded code; a waiting one under a run that is
    inactive but not yet swept (a deadline just passed) answers the run's code at once.
    """
    refusal = admission_refusal(admission)
    if refusal is None and admission.state == AdmissionState.WAITING:
        chain = list(Run.objects.filter(id__in=path_ids(admission.parent_path)).order_by("depth"))
        refusal = chain_refusal(chain)
    return refusal
