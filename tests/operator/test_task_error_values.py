"""A task's ``error`` is any JSON value: every reader of it copes with every shape.

``POST /v1/claims/{id}/fail`` takes ``error`` as the worker sends it. A string once made every
later scrape of ``/v1/metrics`` answer 500 (the event fold assumed an object), so each shape
goes through the readers an operator and a client meet: the metrics, the dashboard, the
admin's task and event pages, and the task itself over the API.
"""

import pytest
from django.contrib.auth.models import User
from django.test import Client

from coordination.domain.task_errors import error_code
from coordination.models import Event
from tests.conftest import make_client
from tests.operator.test_metrics import scrape, total, value
from tests.waiting import wait_until

ERRORS = {
    "string": "boom",
    "number": 42,
    "null": None,
    "list": ["boom", 1, {"code": "lease_expired"}],
    "object": {"code": "handler_error", "message": "boom"},
    "object-without-code": {"message": "boom"},
    "object-with-a-non-string-code": {"code": {"nested": True}},
}


@pytest.fixture
def staff_client(db):
    user = User.objects.create_superuser("operator", "operator@example.com", "secret")
    client = Client()
    client.force_login(user)
    return client


def fail_twice(api, error) -> dict:
    """Submit a task with two attempts and fail both with ``error`` (a retry, then the last)."""
    assert api.put("/v1/mailboxes/jobs", {"mode": "WORK"}, format="json").status_code in (200, 201)
    run = api.post("/v1/runs", {}, format="json").json()
    task = api.post("/v1/mailboxes/jobs/tasks", {"runId": run["id"], "maxAttempts": 2}, format="json").json()
    for retry in (True, False):
        (claim,) = api.post("/v1/mailboxes/jobs/claims", {"runId": run["id"]}, format="json").json()["claims"]
        failed = api.post(f"/v1/claims/{claim['claimId']}/fail", {"error": error, "retry": retry}, format="json")
        assert failed.status_code == 200, failed.content
        assert failed.json()["error"] == error
    return task


# The metrics fold reads committed events through the view's own queries.
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("error", list(ERRORS.values()), ids=list(ERRORS))
def test_every_json_value_as_error_is_read_back_scraped_and_shown(project, anon, staff_client, error):
    api = make_client(project)
    before = scrape(anon)
    task = fail_twice(api, error)

    # The fold reads an event once no older transaction is in flight (on PostgreSQL, cluster
    # wide): scrape until it has, each scrape answering 200, then once more. On the old code
    # the scrape that met the event answered 500, and so did every later one.
    failed_before = total(before, "runstate_tasks_finished_total", state="FAILED")
    wait_until(
        lambda: total(scrape(anon), "runstate_tasks_finished_total", state="FAILED") > failed_before,
        what="the metrics fold to count the failure",
    )
    samples = scrape(anon)
    assert total(samples, "runstate_tasks_finished_total", state="FAILED") == failed_before + 1
    # Only the service's own lease-expiry failure counts as one, whatever the worker sent.
    assert value(samples, "runstate_lease_expiries_total", outcome="failed") == value(
        before, "runstate_lease_expiries_total", outcome="failed"
    )

    read = api.get(f"/v1/tasks/{task['id']}")
    assert read.status_code == 200
    assert (read.json()["state"], read.json()["error"]) == ("FAILED", error)
    events = Event.objects.filter(subject_id=task["id"], type__in=["task.requeued", "task.failed"]).order_by("id")
    assert [(e.type, e.data["error"]) for e in events] == [("task.requeued", error), ("task.failed", error)]

    for page in ("/admin/dashboard/", "/admin/dashboard/panels"):
        assert staff_client.get(page).status_code == 200, page
    assert staff_client.get(f"/admin/coordination/task/{task['id']}/change/").status_code == 200
    failed_event = Event.objects.get(type="task.failed", subject_id=task["id"])
    assert staff_client.get(f"/admin/coordination/event/{failed_event.id}/change/").status_code == 200
    assert staff_client.get("/admin/coordination/event/").status_code == 200


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"code": "lease_expired", "message": "The lease expired with no attempts left."}, "lease_expired"),
        ({"code": "handler_error", "type": "ValueError"}, "handler_error"),
        ({"type": "ValueError", "message": "boom"}, None),
        ({"code": 7}, None),
        ({"code": None}, None),
        ("lease_expired", None),
        (42, None),
        (4.2, None),
        (True, None),
        (None, None),
        (["lease_expired"], None),
        ([{"code": "lease_expired"}], None),
    ],
)
def test_error_code_reads_a_string_code_of_an_object_and_nothing_else(error, code):
    assert error_code(error) == code


def test_the_schema_says_what_error_may_be(anon):
    schema = anon.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for component in ("FailInRequest", "TaskOut"):
        error = schema["components"]["schemas"][component]["properties"]["error"]
        assert "any JSON value" in error["description"], component
        assert "type" not in error, component  # no shape imposed: an object, a string, a number...
