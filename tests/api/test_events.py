"""The event log over HTTP: cursor paging and filters."""

import pytest

from coordination.services.runs import run_cancel, run_create

# Committed transactions: on PostgreSQL a reader sees events only once their transaction ended.
pytestmark = pytest.mark.django_db(transaction=True)


def page(api, query=""):
    response = api.get(f"/v1/events{query}")
    assert response.status_code == 200, response.json()
    return response.json()


def test_cursor_pages_through_every_event_once(api, project):
    runs = [run_create(project_id=project.id, name=f"r{i}") for i in range(7)]
    seen, cursor = [], ""
    for _ in range(10):
        body = page(api, f"?limit=3&after={cursor}")
        assert body["nextCursor"], "nextCursor is never null"
        seen += [e["subjectId"] for e in body["events"]]
        if not body["events"]:
            assert body["nextCursor"] == cursor
            break
        cursor = body["nextCursor"]
    assert seen == [str(r.id) for r in runs]


def test_event_shape(api, project):
    run = run_create(project_id=project.id, name="x")
    run_cancel(run_id=run.id, project_id=project.id, reason="why")
    events = page(api)["events"]
    assert [e["type"] for e in events] == ["run.created", "run.cancelled"]
    cancelled = events[1]
    assert cancelled["runId"] == cancelled["subjectId"] == str(run.id)
    assert cancelled["data"] == {"reason": "why"}
    assert cancelled["createdAt"].endswith("Z")
    assert isinstance(cancelled["id"], str)


def test_filters_by_types_and_by_run_subtree(api, project):
    root = run_create(project_id=project.id)
    inner = run_create(project_id=project.id, parent_id=root.id)
    outsider = run_create(project_id=project.id)
    run_cancel(run_id=inner.id, project_id=project.id)

    subtree = page(api, f"?runId={root.id}")["events"]
    assert {e["runId"] for e in subtree} == {str(root.id), str(inner.id)}
    assert str(outsider.id) not in {e["subjectId"] for e in subtree}

    only_cancels = page(api, "?types=run.cancelled,run.completed")["events"]
    assert [e["subjectId"] for e in only_cancels] == [str(inner.id)]


def test_an_empty_page_keeps_the_cursor(api, project):
    run_create(project_id=project.id)
    body = page(api)
    again = page(api, f"?after={body['nextCursor']}")
    assert again["events"] == [] and again["nextCursor"] == body["nextCursor"]


def test_another_projects_events_are_invisible(api, other_api, other_project):
    run = run_create(project_id=other_project.id)
    assert page(api)["events"] == []
    assert len(page(other_api)["events"]) == 1
    response = api.get(f"/v1/events?runId={run.id}")
    assert response.status_code == 404 and response.json()["error"]["code"] == "NOT_FOUND"


@pytest.mark.parametrize("query", ["?after=abc", "?after=1", "?after=-1--2", "?limit=0", "?limit=1001", "?waitMs=-1"])
def test_bad_event_queries_are_400(api, query):
    response = api.get(f"/v1/events{query}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "VALIDATION_ERROR"


@pytest.mark.parametrize(
    "url", ["/v1/events?runId=", "/v1/events/stream?runId=", "/v1/events?limit=", "/v1/events?waitMs="]
)
def test_an_empty_filter_is_400_not_ignored(api, project, url):
    """An empty ``runId`` once listed every event of the project (found by Schemathesis)."""
    run_create(project_id=project.id)
    response = api.get(url)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "VALIDATION_ERROR"


@pytest.mark.parametrize("fast", [True, False], ids=["statement", "careful"])
@pytest.mark.parametrize("by_id", [False, True], ids=["claim", "claim_by_id"])
def test_a_claimed_event_names_its_claim(api, project, settings, fast, by_id):
    """``task.claimed`` carries ``claimId``, ``attempt`` and ``workerId`` alike on both paths.

    A claimer whose answer was lost (its request cancelled in flight) finds what it took by
    its ``workerId`` and releases it by ``claimId``, never building a claim id itself.
    """
    from django.db import connection

    from coordination.services.claims import claim_release, task_claim, task_claim_by_id
    from coordination.services.mailboxes import mailbox_ensure
    from coordination.services.tasks import task_submit

    if fast and connection.vendor != "postgresql":
        pytest.skip("the single-statement path is PostgreSQL only")
    settings.RUNSTATE_FAST_PATHS = fast
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id)
    task, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    claims = []
    for attempt in (1, 2):  # a second attempt: the id follows the attempt
        if by_id:
            claims.append(task_claim_by_id(project_id=project.id, task_id=task.id, worker_id=f"w/{attempt}"))
        else:
            (claim,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=run.id, worker_id=f"w/{attempt}")
            claims.append(claim)
        claim_release(project_id=project.id, claim_id=claims[-1].claim_id)
    claimed = page(api, "?types=task.claimed")["events"]
    assert [e["data"] for e in claimed] == [
        {"attempt": claim.attempt, "workerId": f"w/{claim.attempt}", "claimId": claim.claim_id} for claim in claims
    ]
    assert [claim.attempt for claim in claims] == [1, 2]
