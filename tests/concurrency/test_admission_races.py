"""Admissions under races: never more than maxActive admitted, and no waiter lost when a slot frees."""

import random
import threading

import pytest
from django.db import connection, connections

from coordination.domain import exceptions
from coordination.models import Admission, AdmissionConfig, Event, Run
from coordination.services.admissions import admission_configure, admission_request, admission_withdraw
from coordination.services.keys import project_ensure
from coordination.services.runs import run_cancel, run_complete, run_create
from tests.concurrency.util import run_in_threads
from tests.conftest import make_client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]

# One statement, so one snapshot: how many hold a slot, how many wait, and how many admitted
# children are still active (stored state ACTIVE, no deadline involved here).
SNAPSHOT_SQL = """
SELECT
    (SELECT count(*) FROM coordination_admission WHERE config_id = %(config)s AND holds_slot),
    (SELECT count(*) FROM coordination_admission WHERE config_id = %(config)s AND state = 'WAITING'),
    (SELECT count(*) FROM coordination_admission a JOIN coordination_run r ON r.id = a.run_id
      WHERE a.config_id = %(config)s AND r.stored_state = 'ACTIVE'),
    (SELECT max_active FROM coordination_admissionconfig WHERE id = %(config)s)
"""


class Checker(threading.Thread):
    """Read snapshots from a connection of its own until stopped; record every violation."""

    def __init__(self, config_id):
        super().__init__(daemon=True)
        self.config_id = config_id
        self.stop = threading.Event()
        self.violations = []
        self.snapshots = 0

    def run(self):
        try:
            while not self.stop.is_set():
                self.check()
        finally:
            connection.close()

    def check(self):
        with connection.cursor() as cursor:
            cursor.execute(SNAPSHOT_SQL, {"config": self.config_id})
            holding, waiting, active_children, max_active = cursor.fetchone()
        self.snapshots += 1
        if holding > max_active or active_children > max_active:
            self.violations.append(("over the limit", holding, active_children, max_active))
        if waiting > 0 and holding < max_active:
            self.violations.append(("a waiter left behind a free slot", holding, waiting, max_active))


def _line_consistent(config_id):
    config = AdmissionConfig.objects.get(id=config_id)
    holding = Admission.objects.filter(config_id=config_id, holds_slot=True).count()
    waiting = Admission.objects.filter(config_id=config_id, state="WAITING").count()
    assert (config.admitted, config.waiting) == (holding, waiting)
    return config


def test_24_threads_request_and_end_children_never_more_than_max_active_20_rounds():
    project = project_ensure(name="admissions")
    parent = run_create(project_id=project.id)
    config, _ = admission_configure(project_id=project.id, run_id=parent.id, max_active=3)
    checker = Checker(config.id)
    checker.start()
    try:
        for round_ in range(20):

            def request(i, round_=round_):
                answer = admission_request(project_id=project.id, run_id=parent.id, name=f"r{round_}-{i}")
                return answer.admission.state

            def end_one(i):
                # End whichever admitted child is still active (others may race for the same one).
                runs = list(Run.objects.filter(parent_id=parent.id, stored_state="ACTIVE").values_list("id", flat=True))
                if not runs:
                    return "none"
                run_id = random.choice(runs)
                try:
                    (run_complete if i % 2 else run_cancel)(run_id=run_id, project_id=project.id)
                except exceptions.Conflict:
                    return "raced"
                return "ended"

            results = run_in_threads(
                [lambda i=i: request(i) for i in range(12)] + [lambda i=i: end_one(i) for i in range(12)]
            )
            assert set(results) <= {"ADMITTED", "WAITING", "none", "raced", "ended"}
            checker.check()
            _line_consistent(config.id)
        # Drain: end every admitted child until nobody waits; each end admits the next.
        while Admission.objects.filter(config_id=config.id, state="WAITING").exists():
            run_id = Admission.objects.filter(config_id=config.id, holds_slot=True).values_list("run_id", flat=True)[0]
            run_complete(run_id=run_id, project_id=project.id)
    finally:
        checker.stop.set()
        checker.join(30)
    assert checker.snapshots > 20
    assert checker.violations == []
    config = _line_consistent(config.id)
    total = Admission.objects.filter(config_id=config.id).count()
    assert total == 20 * 12
    assert Admission.objects.filter(config_id=config.id, state="ADMITTED").count() == total
    # Every admission.admitted event names its own new child; admitted in ticket order.
    admitted = list(
        Admission.objects.filter(config_id=config.id).order_by("admitted_at", "ticket").values_list("ticket", flat=True)
    )
    assert admitted == sorted(admitted), "first come, first served"
    events = Event.objects.filter(type="admission.admitted", run_id=parent.id)
    assert events.count() == total
    assert len({e.data["runId"] for e in events}) == total


def test_after_each_end_commits_the_next_waiter_is_admitted_or_still_first_50_rounds():
    """Checked from another connection right after each end's commit, with ends racing each other."""
    project = project_ensure(name="admissions")
    parent = run_create(project_id=project.id)
    config, _ = admission_configure(project_id=project.id, run_id=parent.id, max_active=2)
    for _ in range(2 + 100):
        admission_request(project_id=project.id, run_id=parent.id)
    for _ in range(50):
        holders = list(Admission.objects.filter(config_id=config.id, holds_slot=True).order_by("ticket"))
        assert len(holders) == 2
        head_before = Admission.objects.filter(config_id=config.id, state="WAITING").order_by("ticket").first()

        def end_and_look(admission):
            run_complete(run_id=admission.run_id, project_id=project.id)
            # Our commit is done: a fresh connection must see the slot taken again.
            with connections["default"].cursor() as cursor:
                cursor.execute(SNAPSHOT_SQL, {"config": config.id})
                return cursor.fetchone()

        snapshots = run_in_threads([lambda a=a: end_and_look(a) for a in holders])
        for holding, waiting, _, max_active in snapshots:
            assert waiting == 0 or holding == max_active, (holding, waiting)
        head_before.refresh_from_db()
        assert head_before.state == "ADMITTED"
    _line_consistent(config.id)


def test_parent_cancel_answers_every_long_polling_waiter_at_once_and_cancels_them(project):
    parent = run_create(project_id=project.id)
    admission_configure(project_id=project.id, run_id=parent.id, max_active=1)
    admission_request(project_id=project.id, run_id=parent.id)
    clients = [make_client(project) for _ in range(8)]
    started = threading.Barrier(len(clients) + 1)
    answers = [None] * len(clients)

    def wait(i):
        try:
            started.wait()
            answers[i] = clients[i].post(
                f"/v1/runs/{parent.id}/admissions", {"key": f"w{i}", "waitMs": 20000}, format="json"
            )
        finally:
            connection.close()

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    started.wait()
    for _ in range(200):  # every waiter is in line before the cancel
        if Admission.objects.filter(parent_id=parent.id, state="WAITING").count() == len(clients):
            break
        threading.Event().wait(0.02)
    run_cancel(run_id=parent.id, project_id=project.id, reason="enough")
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    for response in answers:
        assert response.status_code == 409, response.content
        assert response.json()["error"]["code"] == "SCOPE_CANCELLED"
    states = set(Admission.objects.filter(parent_id=parent.id, key__isnull=False).values_list("state", flat=True))
    assert states == {"CANCELLED"}
    assert Event.objects.filter(type="admission.cancelled", run_id=parent.id).count() == len(clients)


def test_the_same_key_from_16_threads_makes_one_admission_30_rounds():
    project = project_ensure(name="admissions")
    parent = run_create(project_id=project.id)
    admission_configure(project_id=project.id, run_id=parent.id, max_active=1)
    for round_ in range(30):
        ids = run_in_threads(
            [
                lambda key=f"k{round_}": (
                    admission_request(project_id=project.id, run_id=parent.id, key=key).admission.id
                )
                for _ in range(16)
            ]
        )
        assert len(set(ids)) == 1
    assert Admission.objects.filter(parent_id=parent.id).count() == 30


def test_withdraws_racing_an_end_never_admit_a_withdrawn_waiter_30_rounds():
    project = project_ensure(name="admissions")
    parent = run_create(project_id=project.id)
    config, _ = admission_configure(project_id=project.id, run_id=parent.id, max_active=1)
    holder = admission_request(project_id=project.id, run_id=parent.id).admission
    for _ in range(30):
        waiters = [admission_request(project_id=project.id, run_id=parent.id).admission for _ in range(4)]

        def withdraw(admission):
            try:
                return admission_withdraw(project_id=project.id, admission_id=admission.id).state
            except exceptions.InvalidState:
                return "ADMITTED"

        results = run_in_threads(
            [lambda h=holder: run_complete(run_id=h.run_id, project_id=project.id) and "ended"]
            + [lambda w=w: withdraw(w) for w in waiters]
        )
        assert set(results[1:]) <= {"WITHDRAWN", "ADMITTED"}
        admitted_now = [w for w in waiters if Admission.objects.get(id=w.id).state == "ADMITTED"]
        assert len(admitted_now) <= 1
        for w in waiters:
            w.refresh_from_db()
            assert w.state in {"WITHDRAWN", "ADMITTED"}
        config = _line_consistent(config.id)
        assert config.waiting == 0 and config.admitted == len(admitted_now)
        if admitted_now:
            holder = admitted_now[0]
        else:
            holder = admission_request(project_id=project.id, run_id=parent.id).admission
            assert holder.state == "ADMITTED"


def _cancel_race_round(project, parent, config):
    def request():
        try:
            return admission_request(project_id=project.id, run_id=parent.id).admission.state
        except exceptions.ScopeCancelled:
            return "refused"

    def end_first_admitted():
        run_id = (
            Admission.objects.filter(config_id=config.id, holds_slot=True)
            .order_by("ticket")
            .values_list("run_id", flat=True)
            .first()
        )
        if run_id is None:
            return "none"
        try:
            run_complete(run_id=run_id, project_id=project.id)
        except exceptions.Conflict:
            return "raced"
        return "ended"

    def cancel():
        run_cancel(run_id=parent.id, project_id=project.id)
        return "cancelled"

    return run_in_threads([request] * 6 + [end_first_admitted] * 3 + [cancel])


def test_a_parent_cancel_racing_requests_and_child_ends_leaves_no_waiter_and_no_late_child_15_rounds():
    project = project_ensure(name="admissions")
    for _ in range(15):
        parent = run_create(project_id=project.id)
        config, _ = admission_configure(project_id=project.id, run_id=parent.id, max_active=2)
        for _ in range(4):
            admission_request(project_id=project.id, run_id=parent.id)
        results = _cancel_race_round(project, parent, config)
        assert results[-1] == "cancelled"
        config = _line_consistent(config.id)
        assert (config.admitted, config.waiting) == (0, 0)
        assert not Admission.objects.filter(config_id=config.id, state="WAITING").exists()
        parent.refresh_from_db()
        cancelled = Event.objects.get(type="run.cancelled", subject_id=str(parent.id))
        children = Run.objects.filter(parent_id=parent.id)
        # Every child was created before the cancel took the parent: none by the cancel itself
        # (its waiters are cancelled, not admitted), none after.
        assert not Event.objects.filter(type="run.created", txid=cancelled.txid, data__parentId=str(parent.id)).exists()
        assert all(child.created_at <= parent.ended_at for child in children)
        admitted = Admission.objects.filter(config_id=config.id, state="ADMITTED")
        assert admitted.count() == children.count()
