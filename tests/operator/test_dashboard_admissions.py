"""The dashboard's admissions panel: admitted and waiting per parent run."""

import re

import pytest

from coordination.services.admissions import admission_configure, admission_request
from coordination.services.runs import run_create
from tests.operator.test_dashboard import DASHBOARD, PANELS, text_of

pytestmark = pytest.mark.django_db


def admission_row(html: str, run_id) -> str:
    return text_of(re.search(rf'<tr data-admission-run="{run_id}">(.*?)</tr>', html, re.S).group(1))


def test_the_panel_shows_admitted_and_waiting_per_parent_run(admin_client, project, other_project):
    parent = run_create(project_id=project.id, name="crawl")
    admission_configure(project_id=project.id, run_id=parent.id, max_active=2)
    for _ in range(5):
        admission_request(project_id=project.id, run_id=parent.id)
    elsewhere = run_create(project_id=other_project.id, name="elsewhere")
    admission_request(project_id=other_project.id, run_id=elsewhere.id)
    html = admin_client.get(DASHBOARD).content.decode()
    assert admission_row(html, parent.id).split()[:4] == ["crawl", str(parent.id)[:12] + "…", "2", "2"]
    assert admission_row(html, parent.id).split()[-1] == "3"
    panels = admin_client.get(PANELS, {"project": project.name}).json()["panels"]
    assert str(parent.id) in panels["admissions"] and str(elsewhere.id) not in panels["admissions"]
