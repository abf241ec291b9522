"""A stateful model check of task groups against DESIGN.md "Task groups".

Hypothesis drives one fresh group per example (FIRST_ACCEPTED, N_ACCEPTED with threshold
1-4, or ALL_TERMINAL; with or without expectedMembers) through the real services: submit
(with or without key, resubmits included), joining a finished task from another run, a
worker claiming on the gate and completing, failing or holding a member, cancelling a member,
accept, reject, close, seal, the group's deadline passing (the sweep finalizes it), and
cancelling or completing the parent run. Each step's answer (including the error code) is predicted by
a small pure-Python model written from DESIGN.md alone (``coordination.domain.group_rules`` is
deliberately not used); after every step the database must agree with the model, and the
group's counters must equal a recount of the model's members (late verdicts included).

A failure prints the shortest sequence Hypothesis found, with ``note()`` lines naming the
members each step acted on.
"""

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from coordination.domain import exceptions
from coordination.models import Event, GroupMember, Run, Task, TaskGroup
from coordination.services.claims import claim_complete, claim_fail, claim_release, task_claim
from coordination.services.groups import (
    group_close,
    group_create,
    group_join,
    group_submit,
    group_verdict,
    groups_finalize_due,
)
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_cancel, run_complete, run_create
from coordination.services.tasks import task_cancel, task_submit
from tests.group_counts import recount, recounted, stored_counts
from tests.machines import machine_settings

# The model ------------------------------------------------------------------------------
# Plain strings on purpose: the model is written from DESIGN.md, not from the code's enums.

QUEUED, RUNNING, CANCEL_REQUESTED = "QUEUED", "RUNNING", "CANCELLATION_REQUESTED"
SUCCEEDED, FAILED, CANCELLED = "SUCCEEDED", "FAILED", "CANCELLED"
TERMINAL = {SUCCEEDED, FAILED, CANCELLED, "EXPIRED"}
HELD = {RUNNING, CANCEL_REQUESTED}
ACCEPTED, REJECTED = "ACCEPTED", "REJECTED"
FIRST_ACCEPTED, N_ACCEPTED, ALL_TERMINAL = "FIRST_ACCEPTED", "N_ACCEPTED", "ALL_TERMINAL"
MAX_MEMBERS = 100
LONG_LEASE_MS = 24 * 3600 * 1000  # no lease may run out while an example runs


@dataclass
class ModelMember:
    """One member as DESIGN.md describes it: its task's state and its verdict."""

    task_id: uuid.UUID
    key: str | None
    input: dict
    state: str = QUEUED
    verdict: str | None = None
    late: bool = False
    claim_id: str | None = None  # the claim a worker got on it, kept after it is spent

    @property
    def still_acceptable(self) -> bool:
        """Not terminal, or SUCCEEDED without a verdict."""
        return self.state not in TERMINAL or (self.state == SUCCEEDED and self.verdict is None)

    @property
    def finished(self) -> bool:
        """Terminal and, if SUCCEEDED, judged."""
        return self.state in TERMINAL and (self.state != SUCCEEDED or self.verdict is not None)


@dataclass
class GroupModel:
    """The group: condition, members, closed and finalized, per the condition table."""

    condition: str
    threshold: int | None
    expected: int | None
    members: list[ModelMember] = field(default_factory=list)
    closed: bool = False
    finalized: bool = False
    outcome: str | None = None
    reason: str | None = None

    @property
    def state(self) -> str:
        if self.finalized:
            return "FINALIZED"
        return "SEALED" if self.closed else "OPEN"

    def by_key(self, key: str) -> ModelMember | None:
        return next((m for m in self.members if m.key == key), None)

    def evaluate(self) -> None:
        """Apply the condition table; finalize when it decides."""
        if self.finalized:
            return
        accepted = sum(1 for m in self.members if m.verdict == ACCEPTED)
        if self.condition == FIRST_ACCEPTED:
            if accepted >= 1:
                self.finalize("SUCCESS", "first_accepted")
        elif self.condition == N_ACCEPTED:
            if accepted >= self.threshold:
                self.finalize("SUCCESS", "threshold_reached")
            elif self.closed and accepted + sum(m.still_acceptable for m in self.members) < self.threshold:
                self.finalize("FAILURE", "threshold_unreachable")
        elif self.closed and all(m.finished for m in self.members):
            rejected = any(m.verdict == REJECTED for m in self.members)
            self.finalize("SUCCESS" if accepted >= 1 and not rejected else "FAILURE", "all_terminal")

    def finalize(self, outcome: str, reason: str) -> None:
        """Record the decision and cancel every unfinished member."""
        self.finalized, self.closed, self.outcome, self.reason = True, True, outcome, reason
        for member in self.members:
            if member.state not in TERMINAL:
                member.state = CANCELLED


def code_of(call, **kwargs):
    """Call a service; return ``(result, None)`` or ``(None, error code)``."""
    try:
        return call(**kwargs), None
    except exceptions.CoordinationError as error:
        return None, error.code


# The machine ----------------------------------------------------------------------------


def refused_a_member(model: GroupModel, code: str | None) -> bool:
    """Check the answer to a new member: refused when the group is closed (or finalized) or full, else taken.

    Return whether the model says it is refused.
    """
    if model.closed:  # closed or finalized
        assert code == exceptions.GroupClosed.code, code
        return True
    if len(model.members) >= MAX_MEMBERS:
        assert code == exceptions.GroupFull.code, code
        return True
    assert code is None, code
    return False


class GroupMachine(RuleBasedStateMachine):
    """Every operation runs against the services and the model; they must agree.

    Members are named by their submission index ``#n``; a rule's ``i`` picks among the
    members it can act on (``i`` modulo their number), and ``note()`` says which one.
    """

    @initialize(
        condition=st.sampled_from([FIRST_ACCEPTED, N_ACCEPTED, ALL_TERMINAL]),
        threshold=st.integers(1, 4),
        expected=st.one_of(st.none(), st.integers(0, 4)),
        initial=st.integers(0, 4),
        close_after=st.integers(0, 5),
        end_parent_after=st.integers(0, 12),
        cancels=st.booleans(),
        rejects=st.booleans(),
    )
    def create_group(self, condition, threshold, expected, initial, close_after, end_parent_after, cancels, rejects):
        threshold = threshold if condition == N_ACCEPTED else None
        if expected is not None:
            expected = (threshold or 1) + expected  # expectedMembers >= threshold
        self.project = project_ensure(name=f"hyp-{uuid.uuid4().hex[:16]}")
        self.mailbox, _ = mailbox_ensure(
            project_id=self.project.id, name="work", mode="WORK", lease_ttl_ms=LONG_LEASE_MS
        )
        self.parent = run_create(project_id=self.project.id, name="parent")
        self.elsewhere = run_create(project_id=self.project.id, name="elsewhere")  # tasks that join
        group = group_create(
            project_id=self.project.id,
            mailbox_name="work",
            condition=condition,
            threshold=threshold,
            expected_members=expected,
            parent_scope_id=self.parent.id,
            name="machine",
        )
        self.group_id, self.gate_id = group.id, group.scope_id
        self.model = GroupModel(condition, threshold, expected)
        self.parent_end: str | None = None  # CANCELLED or COMPLETED once the parent run ended
        self.probed = False  # whether probe_finalized_group has run
        # Steering, not semantics, so that more steps work on an undecided group: close waits
        # for ``close_after`` members; about half the examples end the parent run (once it
        # has ``end_parent_after`` members); some never cancel a member, some never reject.
        # All drawn here, once, so that they never get in the way of shrinking a failure.
        self.close_after, self.cancels, self.rejects = close_after, cancels, rejects
        self.end_parent_after = end_parent_after if end_parent_after <= 6 else None
        # A few members from the start (swarm testing turns the submit rule off in some examples).
        for _ in range(initial):
            self._submit(None, 0)

    # Helpers --------------------------------------------------------------------------

    def pick(self, predicate, i: int) -> int | None:
        """Return the index of the ``i``-th member (cyclically) matching ``predicate``, or None."""
        found = [n for n, m in enumerate(self.model.members) if predicate(m)]
        return found[i % len(found)] if found else None

    def gate_refusal(self) -> set[str]:
        """The codes a worker may hear on the gate once it is inactive.

        The gate is cancelled exactly when the group finalized. After the parent was
        completed the group's finalize also cancels the gate, and DESIGN.md does not say
        which of the two inactive runs names "the run's code": either is accepted then.
        """
        if self.parent_end == "COMPLETED":
            return {exceptions.ScopeCompleted.code, exceptions.ScopeCancelled.code}
        return {exceptions.ScopeCancelled.code}

    def judgeable(self, member: ModelMember) -> bool:
        return member.verdict is None and (member.state == SUCCEEDED or (self.rejects and member.state in TERMINAL))

    # Submit ---------------------------------------------------------------------------

    @precondition(lambda self: not self.model.closed)
    @rule(key=st.one_of(st.none(), st.sampled_from(["a", "b", "c"])), value=st.integers(0, 1))
    def submit(self, key, value):
        self._submit(key, value)

    @precondition(lambda self: self.model.closed and not self.model.finalized)
    @rule(i=st.integers(0, MAX_MEMBERS), how=st.sampled_from(["same input", "other input", "no key"]))
    def submit_after_close(self, i, how):
        """After close: resubmit a member's key (same or other input), or submit without a key.

        (After finalize the same is probed once, in ``probe_finalized_group``.)
        """
        n = self.pick(lambda m: m.key is not None, i)
        if n is None or how == "no key":
            self._submit(None, 0)
        else:
            member = self.model.members[n]
            self._submit(member.key, member.input["v"] if how == "same input" else 1 - member.input["v"])

    def _submit(self, key: str | None, value: int) -> None:
        model, input = self.model, {"v": value}
        task_and_group, code = code_of(
            group_submit, project_id=self.project.id, group_id=self.group_id, input=input, key=key
        )
        existing = model.by_key(key) if key is not None else None
        if existing is not None:
            if existing.input == input:
                # The same key and input answer the existing member, even after close.
                assert code is None, code
                task, created, _ = task_and_group
                assert (task.id, created) == (existing.task_id, False)
            elif model.closed:
                # DESIGN.md names neither code for another input on an existing key after close.
                assert code in {exceptions.KeyConflict.code, exceptions.GroupClosed.code}, code
            else:
                assert code == exceptions.KeyConflict.code, code
            return
        if refused_a_member(model, code):
            return
        task, created, group = task_and_group
        assert created and task.state == QUEUED and task.group_id == self.group_id
        assert task.run_id == self.gate_id
        model.members.append(ModelMember(task.id, key, input))
        note(f"submitted #{len(model.members) - 1} (key {key!r})")
        if model.expected is not None and len(model.members) >= model.expected:
            model.closed = True  # the submit that reaches expectedMembers closes the group
        model.evaluate()
        assert group.state == model.state

    @rule(succeed=st.booleans())
    def join_finished_task(self, succeed):
        """Join a task finished on another run (so that no gate claim sees it): a member with its facts."""
        model = self.model
        task, _ = task_submit(project_id=self.project.id, mailbox=self.mailbox, run_id=self.elsewhere.id, input={})
        (claim,) = task_claim(project_id=self.project.id, mailbox=self.mailbox, run_id=self.elsewhere.id)
        if succeed:
            claim_complete(project_id=self.project.id, claim_id=claim.claim_id, outcome={})
        else:
            claim_fail(project_id=self.project.id, claim_id=claim.claim_id, error={}, retry=False)
        joined, code = code_of(group_join, project_id=self.project.id, group_id=self.group_id, task_id=task.id)
        if refused_a_member(model, code):
            return
        model.members.append(ModelMember(task.id, None, {}, state=SUCCEEDED if succeed else FAILED))
        note(f"joined #{len(model.members) - 1} ({model.members[-1].state})")
        if model.expected is not None and len(model.members) >= model.expected:
            model.closed = True
        model.evaluate()
        task, group = joined
        assert group.state == model.state

    # Workers --------------------------------------------------------------------------

    @precondition(
        lambda self: (
            not self.model.finalized and (not self.model.closed or any(m.state == QUEUED for m in self.model.members))
        )
    )
    @rule(i=st.integers(0, MAX_MEMBERS), then=st.sampled_from(["complete", "fail", "hold"]))
    def claim(self, i, then):
        """A worker on the gate claims every queued member, keeps one, releases the rest.

        It then completes it, fails it, or holds it (to finish it later). With nothing
        queued the claim answers nothing. (After finalize: ``probe_finalized_group``.)
        """
        model = self.model
        n = self.pick(lambda m: m.state == QUEUED, i)
        got, code = code_of(
            task_claim, project_id=self.project.id, mailbox=self.mailbox, run_id=self.gate_id, max_claims=100
        )
        assert code is None, code
        assert {c.task.id for c in got} == {m.task_id for m in model.members if m.state == QUEUED}
        if n is None:
            return
        target = model.members[n]
        for claim in got:
            if claim.task.id == target.task_id:
                target.claim_id = claim.claim_id
            else:
                claim_release(project_id=self.project.id, claim_id=claim.claim_id)
        target.state = RUNNING
        note(f"claimed #{n}, then {then}")
        if then == "complete":
            self._complete(n)
        elif then == "fail":
            self._fail(n)

    @precondition(
        lambda self: (
            any(m.state in HELD for m in self.model.members)
            or (not self.model.finalized and any(m.claim_id for m in self.model.members))
        )
    )
    @rule(i=st.integers(0, MAX_MEMBERS), complete=st.booleans())
    def finish(self, i, complete):
        """The worker holding a member completes or fails it (it may have been asked to cancel).

        With no member held, a worker acts again on a spent claim: ``LEASE_LOST`` while the
        group is undecided. (After finalize: ``probe_finalized_group``.)
        """
        n = self.pick(lambda m: m.state in HELD, i)
        if n is None:
            n = self.pick(lambda m: m.claim_id is not None, i)
        note(f"{'complete' if complete else 'fail'} the claim on #{n} ({self.model.members[n].state})")
        (self._complete if complete else self._fail)(n)

    def _complete(self, n: int) -> None:
        member = self.model.members[n]
        task, code = code_of(claim_complete, project_id=self.project.id, claim_id=member.claim_id, outcome={"n": n})
        if self._claim_gone(member, code):
            return
        assert code is None, code
        # A completion after cancellation was requested records CANCELLED.
        member.state = SUCCEEDED if member.state == RUNNING else CANCELLED
        assert task.state == member.state
        self.model.evaluate()

    def _fail(self, n: int) -> None:
        member = self.model.members[n]
        task, code = code_of(
            claim_fail, project_id=self.project.id, claim_id=member.claim_id, error={"n": n}, retry=False
        )
        if self._claim_gone(member, code):
            return
        assert code is None, code
        member.state = FAILED  # also after a cancellation request: a failure stays a failure
        assert task.state == FAILED
        self.model.evaluate()

    def _claim_gone(self, member: ModelMember, code: str | None) -> bool:
        """Check the refusal of a claim the worker no longer holds; return whether it was one."""
        if member.state in HELD:
            return False
        # Once the group finalized its gate is inactive, and the run's code wins.
        expected = self.gate_refusal() if self.model.finalized else {exceptions.LeaseLost.code}
        assert code in expected, (code, expected)
        return True

    @precondition(lambda self: self.cancels and any(m.state in {QUEUED, RUNNING} for m in self.model.members))
    @rule(i=st.integers(0, MAX_MEMBERS), live=st.integers(0, 3))
    def cancel_member(self, i, live):
        """Cancel a queued or running member; or (``live == 0``) any member at all."""
        n = self.pick(lambda m: m.state in {QUEUED, RUNNING} or live == 0, i)
        member = self.model.members[n]
        note(f"cancel #{n} ({member.state})")
        task, code = code_of(task_cancel, project_id=self.project.id, task_id=member.task_id, reason="machine")
        assert code is None, code
        if member.state == QUEUED:
            member.state = CANCELLED
        elif member.state == RUNNING:
            member.state = CANCEL_REQUESTED
        # A finished task, or a repeated request, is answered unchanged.
        assert task.state == member.state
        self.model.evaluate()

    # Verdicts -------------------------------------------------------------------------

    @precondition(lambda self: any(self.judgeable(m) for m in self.model.members))
    @rule(
        i=st.integers(0, MAX_MEMBERS),
        how=st.sampled_from(["accept", "accept", "accept", "reject", "reject", "accept anyone", "reject anyone"]),
    )
    def judge(self, i, how):
        """Accept or reject a finished, unjudged member, or (``anyone``) any member at all."""
        verdict = REJECTED if how.startswith("reject") and self.rejects else ACCEPTED
        if how.endswith("anyone"):
            n = self.pick(lambda m: True, i)
        elif verdict == ACCEPTED:
            n = self.pick(lambda m: m.state == SUCCEEDED and m.verdict is None, i)
        else:
            n = self.pick(lambda m: m.state in TERMINAL and m.verdict is None, i)
        if n is None:
            n = self.pick(self.judgeable, i)
        model, member = self.model, self.model.members[n]
        note(f"{verdict} #{n} ({member.state}, verdict {member.verdict})")
        result, code = code_of(
            group_verdict, project_id=self.project.id, group_id=self.group_id, task_id=member.task_id, verdict=verdict
        )
        if member.verdict == verdict:
            assert code is None, code  # idempotent: nothing changes, not even ``late``
        elif member.verdict is not None:
            assert code == exceptions.VerdictConflict.code, code
            return
        elif verdict == ACCEPTED and member.state != SUCCEEDED:
            assert code == exceptions.TaskNotSucceeded.code, code
            return
        elif verdict == REJECTED and member.state not in TERMINAL:
            assert code == exceptions.TaskNotFinished.code, code
            return
        else:
            assert code is None, code
            member.verdict, member.late = verdict, model.finalized
            model.evaluate()  # a late verdict changes nothing: evaluate() ignores finalized groups
        assert (result.member.verdict, result.member.late) == (member.verdict, member.late)
        assert (result.group.state, result.group.outcome) == (model.state, model.outcome)

    # Close, end the parent ------------------------------------------------------------

    @precondition(lambda self: not self.model.closed and len(self.model.members) >= self.close_after)
    @rule(seal=st.booleans())
    def close(self, seal):
        """Close (or seal) the group; then close and seal it again, which change nothing."""
        model = self.model
        group, code = code_of(group_close, project_id=self.project.id, group_id=self.group_id, seal=seal)
        assert code is None, code
        model.closed = True
        model.evaluate()
        assert (group.state, group.outcome, group.outcome_reason) == (model.state, model.outcome, model.reason)
        self.close_again()

    def close_again(self) -> None:
        """On a closed group close is idempotent; seal is too, but GROUP_FINALIZED once finalized."""
        model = self.model
        for seal in (False, True):
            group, code = code_of(group_close, project_id=self.project.id, group_id=self.group_id, seal=seal)
            if model.finalized and seal:
                assert code == exceptions.GroupFinalized.code, code
                continue
            assert code is None, code
            assert (group.state, group.outcome, group.outcome_reason) == (model.state, model.outcome, model.reason)

    def may_end_parent(self) -> bool:
        return (
            self.parent_end is None
            and self.end_parent_after is not None
            and len(self.model.members) >= self.end_parent_after
        )

    @precondition(lambda self: self.may_end_parent())
    @rule(complete=st.booleans())
    def end_parent(self, complete):
        """Cancel (or complete) the group's parent run, twice: the second call is idempotent."""
        end, state = (run_complete, "COMPLETED") if complete else (run_cancel, "CANCELLED")
        for _ in range(2):
            run, code = code_of(end, project_id=self.project.id, run_id=self.parent.id)
            assert code is None and run.stored_state == state, code
        self.parent_end = state
        # Any condition finalizes FAILURE/cancelled when an ancestor is cancelled or completed.
        if not self.model.finalized:
            self.model.finalize("FAILURE", "cancelled")

    @precondition(lambda self: not self.model.finalized)
    @rule()
    def deadline_passes(self):
        """The group's deadline passes (moved into the past) and the deadline sweep finalizes it."""
        TaskGroup.objects.filter(id=self.group_id).update(deadline=timezone.now() - timedelta(seconds=1))
        assert groups_finalize_due() >= 1
        self.model.finalize("FAILURE", "deadline")  # anything else would have decided already

    @precondition(
        lambda self: (
            self.model.finalized
            and not any(self.judgeable(m) for m in self.model.members)
            and not self.may_end_parent()
        )
    )
    @rule()
    def idle(self):
        """A decided group with nothing left to judge: the example runs out its steps."""

    # What must hold after every step --------------------------------------------------

    def probe_finalized_group(self) -> None:
        """Once, right after the group finalized: what each kind of caller hears from then on.

        Every call here is refused or answered unchanged, so the database must not move
        (``database_agrees_with_model`` checks it right after).
        """
        model = self.model
        if not model.finalized or self.probed:
            return
        self.probed = True
        note("probe the finalized group: claim, close, seal, submit, resubmit, spent claim")
        got, code = code_of(
            task_claim, project_id=self.project.id, mailbox=self.mailbox, run_id=self.gate_id, max_claims=100
        )
        assert code in self.gate_refusal(), (code, got)  # workers are refused the group's work
        self.close_again()
        self._submit(None, 0)  # GROUP_CLOSED
        n = self.pick(lambda m: m.key is not None, 0)
        if n is not None:
            member = model.members[n]
            self._submit(member.key, member.input["v"])  # the existing member
            self._submit(member.key, 1 - member.input["v"])
        n = self.pick(lambda m: m.claim_id is not None, 0)
        if n is not None:
            self._complete(n)  # the gate's refusal
            self._fail(n)

    @invariant()
    def database_agrees_with_model(self):
        self.probe_finalized_group()
        model = self.model
        group = TaskGroup.objects.get(id=self.group_id)
        assert (group.state, group.outcome, group.outcome_reason) == (model.state, model.outcome, model.reason)
        assert group.member_count == len(model.members)
        assert (group.closed_at is not None, group.finalized_at is not None) == (model.closed, model.finalized)
        rows = {
            task_id: (state, verdict, late)
            for task_id, state, verdict, late in GroupMember.objects.filter(group_id=self.group_id).values_list(
                "task_id", "task__state", "verdict", "late"
            )
        }
        assert rows == {m.task_id: (m.state, m.verdict, m.late) for m in model.members}
        # The counters on the group's row equal a recount, of the model and of the rows.
        expected_counts = recounted((m.state, m.verdict) for m in model.members)
        assert stored_counts(self.group_id) == expected_counts == recount(self.group_id)
        # Events are read through the project (indexed): every example of a run shares one
        # test transaction, so the event table keeps growing while Hypothesis shrinks.
        events = Event.objects.filter(project_id=self.project.id)
        finalized_events = events.filter(type="group.finalized", subject_id=str(self.group_id))
        assert finalized_events.count() == (1 if model.finalized else 0)
        if model.finalized:
            event = finalized_events.get()
            assert (event.data["outcome"], event.data["reason"]) == (model.outcome, model.reason)
            assert not Task.objects.filter(group_id=self.group_id, state__in=[QUEUED, *HELD]).exists()
        # One member.verdict event per recorded verdict (an idempotent repeat writes none).
        verdict_events = sorted(
            (e.subject_id, e.data["verdict"], e.data["late"])
            for e in events.filter(type="member.verdict", data__groupId=str(self.group_id))
        )
        assert verdict_events == sorted((str(m.task_id), m.verdict, m.late) for m in model.members if m.verdict)
        # The gate is cancelled exactly when the group finalized.
        gate_state = Run.objects.filter(id=self.gate_id).values_list("stored_state", flat=True).get()
        assert (gate_state == "CANCELLED") == model.finalized, gate_state


# 40 examples of 30 steps (75 until issue 37: 45-69 s of the PostgreSQL run per way);
# RUNSTATE_MACHINE_EXAMPLES asks for more (tests/machines.py).
MACHINE_SETTINGS = machine_settings(max_examples=40, steps=30)


# A pass takes well under a minute; a failure may shrink for up to Hypothesis's own five
# minutes, which the suite's 300 s timeout would cut short before the minimal sequence prints.
# Both ways on PostgreSQL: the single-statement verdict and finalize (fast paths on) and the
# careful ORM path (off). SQLite always takes the careful path.
@pytest.mark.timeout(600)
@pytest.mark.django_db
@pytest.mark.parametrize("fast_paths", [True, pytest.param(False, marks=pytest.mark.postgres_only)])
def test_groups_follow_the_condition_table(fast_paths):
    with override_settings(RUNSTATE_FAST_PATHS=fast_paths):
        run_state_machine_as_test(GroupMachine, settings=MACHINE_SETTINGS)
