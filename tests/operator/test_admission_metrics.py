"""``runstate_admissions_admitted`` and ``runstate_admissions_waiting`` move with the lines."""

import pytest

from coordination.services.admissions import admission_configure, admission_request
from coordination.services.runs import run_cancel, run_complete, run_create
from tests.operator.test_metrics import scrape, value

pytestmark = pytest.mark.django_db(transaction=True)


def test_admission_gauges_follow_admissions_ends_and_cancels(anon, project):
    before = scrape(anon)
    parent = run_create(project_id=project.id)
    admission_configure(project_id=project.id, run_id=parent.id, max_active=2)
    answers = [admission_request(project_id=project.id, run_id=parent.id) for _ in range(5)]
    lined = scrape(anon)
    assert value(lined, "runstate_admissions_admitted") == value(before, "runstate_admissions_admitted") + 2
    assert value(lined, "runstate_admissions_waiting") == value(before, "runstate_admissions_waiting") + 3
    run_complete(run_id=answers[0].admission.run_id, project_id=project.id)
    moved = scrape(anon)
    assert value(moved, "runstate_admissions_admitted") == value(before, "runstate_admissions_admitted") + 2
    assert value(moved, "runstate_admissions_waiting") == value(before, "runstate_admissions_waiting") + 2
    run_cancel(run_id=parent.id, project_id=project.id)
    after = scrape(anon)
    assert value(after, "runstate_admissions_admitted") == value(before, "runstate_admissions_admitted")
    assert value(after, "runstate_admissions_waiting") == value(before, "runstate_admissions_waiting")
