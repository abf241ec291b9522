"""Every operation of the schema, called with project A's key on project B's ids: 404, never 403 or 200.

The matrix is checked against /v1/schema, so a new endpoint fails this test until it is
listed here (in ``CASES`` or, with a reason, in ``NO_FOREIGN_IDS``).

It has a second column, for a key bound to a run (issue 25): every operation of the schema is
404 on a sibling's objects, 403 ``PERMISSION_DENIED`` when it reaches the whole project
(``BOUND_PROJECT_WIDE``), or open with a reason (``BOUND_OPEN``); and allowed on the objects
of the key's own subtree. A new endpoint fails that column too until it is listed.

The foreign-project column runs twice: through DRF's test client, and through the ASGI
application (``runstate_project.asgi.application``) with the hot path on and A's key cached
as a running API process holds it. There every operation the hot path serves
(``hot.ENDPOINTS``) must enter it and end as ``HOT_FOREIGN`` says (``hot.SERVED``: handed to
the view after its statement touched no row, or before anything), and every other operation
must not enter it; a new hot endpoint fails the column until it is listed there.
"""

from collections import Counter
from contextlib import contextmanager, nullcontext

import pytest

from coordination.api import hot
from coordination.models import Barrier, Mailbox, Message, Run, Task, TaskGroup, Timer
from coordination.reads import selectors
from coordination.services.admissions import admission_request
from coordination.services.barriers import barrier_create
from coordination.services.budgets import budget_create, reservation_create
from coordination.services.claims import task_claim
from coordination.services.groups import group_create, group_submit
from coordination.services.keys import ALL_PERMISSIONS
from coordination.services.mailboxes import mailbox_ensure, mailbox_get
from coordination.services.messages import message_receive, message_send
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.quotas import quota_put
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create
from tests.api.test_hot_path import (
    AsgiClient,
    _cached_key,
    api_process,  # noqa: F401 - the fixture, for the hot path's transport
    hot_endpoint,
)
from tests.conftest import make_client, project_settings

pytestmark = pytest.mark.django_db

# Operations that take no id of another project's object, and why they cannot leak.
NO_FOREIGN_IDS = {
    "healthz": "no data",
    "readyz": "no data",
    "metrics": "takes no id; a key's scrape is its own project's series (tests/operator/test_metrics_access.py)",
    "mailboxes_ensure": "mailbox names are per project: ensuring B's name creates A's own mailbox",
    "pools_put": "pool names are per project: putting B's name creates A's own pool",
    "quotas_put": "quota names are per project: putting B's name creates A's own quota",
    "claims_watch": "takes a worker id, no object: it reads its caller's project only (tests/api/test_claim_watch.py)",
}


@pytest.fixture
def b(other_project):
    """Project B's objects: a run tree, mailboxes, a task held under a claim, a delivery, a group..."""
    pid = other_project.id
    mailbox_ensure(project_id=pid, name="jobs", mode="WORK")
    mailbox_ensure(project_id=pid, name="q", mode="QUEUE")
    mailbox_ensure(project_id=pid, name="b-only", mode="WORK")
    return objects_under(pid, run_create(project_id=pid))


def objects_under(pid, run) -> dict:
    """A task held under a claim, a delivery, a group with a member... all under ``run``.

    The project's mailboxes ``jobs`` (WORK) and ``q`` (QUEUE) must exist.
    """
    jobs = Mailbox.objects.get(project_id=pid, name="jobs")
    queue = Mailbox.objects.get(project_id=pid, name="q")
    task_submit(project_id=pid, mailbox=jobs, run_id=run.id, input={"b": 1})
    (claim,) = task_claim(project_id=pid, mailbox=jobs, run_id=run.id)
    message_send(project_id=pid, mailbox=queue, run_id=run.id, body={"b": 1})
    (delivery,) = message_receive(project_id=pid, mailbox=queue, run_id=run.id)
    group = group_create(project_id=pid, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=run.id)
    member, _, _ = group_submit(project_id=pid, group_id=group.id, input={})
    return {
        "run": str(run.id),
        "task": str(claim.task.id),
        "claim": claim.claim_id,
        "message": str(delivery.message.id),
        "delivery": delivery.delivery_id,
        "group": str(group.id),
        "member": str(member.id),
        "barrier": str(barrier_create(project_id=pid, run_id=run.id, target=2).id),
        "timer": str(timer_create(project_id=pid, run_id=run.id, after_seconds=600).id),
        "admission": str(admission_request(project_id=pid, run_id=run.id).admission.id),
        "lease": _pool_lease(pid, run.id),
        "budget": str(budget_create(project_id=pid, run_id=run.id, name="usd", limit=100).id),
        "reservation": str(reservation_create(project_id=pid, run_id=run.id, budget="usd", amount=1).reservation.id),
    }


def _pool_lease(project_id, run_id) -> str:
    """The pool ``b-gpu`` (A has no pool of that name) and a lease held on it; also the quota ``b-api``.

    Room for two leases: the bound-key column holds one inside and one outside the subtree.
    """
    pool_put(project_id=project_id, name="b-gpu", capacity=2)
    quota_put(project_id=project_id, name="b-api", limit=10, period_ms=1000)
    return str(pool_acquire(project_id=project_id, name="b-gpu", run_id=run_id).lease.id)


@pytest.fixture
def a(project, api):
    """Project A's own mailboxes and group, so that the foreign id is the only thing wrong."""
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    mailbox_ensure(project_id=project.id, name="q", mode="QUEUE")
    run = run_create(project_id=project.id)
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=run.id)
    return {"group": str(group.id), "run": str(run.id)}


def cases(a, b):
    """(operationId, method, path, body) with B's ids in every id slot; ``body`` None: none sent."""
    return [
        ("barriers_create", "post", "/v1/barriers", {"runId": b["run"], "target": 1}),
        ("barriers_retrieve", "get", f"/v1/barriers/{b['barrier']}", None),
        ("barriers_arrive", "post", f"/v1/barriers/{b['barrier']}/arrive", {"key": "k"}),
        ("barriers_next_epoch", "post", f"/v1/barriers/{b['barrier']}/nextEpoch", {}),
        ("barriers_wait", "get", f"/v1/barriers/{b['barrier']}/wait?timeoutMs=0", None),
        ("claims_complete", "post", f"/v1/claims/{b['claim']}/complete", {}),
        ("claims_fail", "post", f"/v1/claims/{b['claim']}/fail", {}),
        ("claims_release", "post", f"/v1/claims/{b['claim']}/release", {}),
        ("claims_renew", "post", f"/v1/claims/{b['claim']}/renew", {}),
        ("deliveries_complete", "post", f"/v1/deliveries/{b['delivery']}/complete", {}),
        ("deliveries_extend", "post", f"/v1/deliveries/{b['delivery']}/extend", {"visibilityMs": 1000}),
        ("deliveries_reject", "post", f"/v1/deliveries/{b['delivery']}/reject", {}),
        ("deliveries_retry", "post", f"/v1/deliveries/{b['delivery']}/retry", {}),
        ("events_list", "get", f"/v1/events?runId={b['run']}", None),
        ("events_stream", "get", f"/v1/events/stream?runId={b['run']}", None),
        (
            "groups_create",
            "post",
            "/v1/groups",
            {"mailbox": "jobs", "condition": "ALL_TERMINAL", "parentScopeId": b["run"]},
        ),
        ("groups_retrieve", "get", f"/v1/groups/{b['group']}", None),
        ("groups_close", "post", f"/v1/groups/{b['group']}/close", {}),
        ("groups_seal", "post", f"/v1/groups/{b['group']}/seal", {}),
        ("groups_join", "post", f"/v1/groups/{a['group']}/join", {"taskId": b["task"]}),
        ("groups_members_submit", "post", f"/v1/groups/{b['group']}/members", {"input": {}}),
        ("groups_members_accept", "post", f"/v1/groups/{b['group']}/members/{b['member']}/accept", {}),
        ("groups_members_reject", "post", f"/v1/groups/{b['group']}/members/{b['member']}/reject", {}),
        ("groups_wait", "get", f"/v1/groups/{b['group']}/wait?timeoutMs=0", None),
        ("mailboxes_retrieve", "get", "/v1/mailboxes/b-only", None),
        ("claims_create", "post", "/v1/mailboxes/jobs/claims", {"runId": b["run"]}),
        ("deliveries_receive", "post", "/v1/mailboxes/q/deliveries", {"runId": b["run"]}),
        ("messages_send", "post", "/v1/mailboxes/q/messages", {"runId": b["run"], "body": {}}),
        ("tasks_submit", "post", "/v1/mailboxes/jobs/tasks", {"runId": b["run"], "input": {}}),
        ("tasks_submit_batch", "post", "/v1/mailboxes/jobs/tasks/batch", {"runId": b["run"], "tasks": [{}]}),
        ("messages_retrieve", "get", f"/v1/messages/{b['message']}", None),
        ("runs_list", "get", f"/v1/runs?parentId={b['run']}", None),
        ("runs_create", "post", "/v1/runs", {"parentId": b["run"]}),
        ("runs_retrieve", "get", f"/v1/runs/{b['run']}", None),
        ("runs_cancel", "post", f"/v1/runs/{b['run']}/cancel", {}),
        ("runs_children_create", "post", f"/v1/runs/{b['run']}/children", {}),
        ("runs_complete", "post", f"/v1/runs/{b['run']}/complete", {}),
        ("tasks_retrieve", "get", f"/v1/tasks/{b['task']}", None),
        ("tasks_cancel", "post", f"/v1/tasks/{b['task']}/cancel", {}),
        ("tasks_rerun", "post", f"/v1/tasks/{b['task']}/rerun", {}),
        ("tasks_result", "get", f"/v1/tasks/{b['task']}/result?timeoutMs=0", None),
        ("timers_create", "post", "/v1/timers", {"runId": b["run"], "afterSeconds": 1}),
        ("timers_retrieve", "get", f"/v1/timers/{b['timer']}", None),
        ("timers_cancel", "post", f"/v1/timers/{b['timer']}/cancel", {}),
        ("timers_wait", "post", f"/v1/timers/{b['timer']}/wait?timeoutMs=0", None),
        ("runs_admission_retrieve", "get", f"/v1/runs/{b['run']}/admission", None),
        ("runs_admission_configure", "put", f"/v1/runs/{b['run']}/admission", {"maxActive": 1}),
        ("runs_admissions_create", "post", f"/v1/runs/{b['run']}/admissions", {}),
        ("admissions_retrieve", "get", f"/v1/admissions/{b['admission']}", None),
        ("admissions_withdraw", "post", f"/v1/admissions/{b['admission']}/withdraw", {}),
        ("pools_retrieve", "get", "/v1/pools/b-gpu", None),
        ("pools_acquire", "post", "/v1/pools/b-gpu/leases", {"runId": b["run"]}),
        ("pool_leases_retrieve", "get", f"/v1/pool-leases/{b['lease']}", None),
        ("pool_leases_renew", "post", f"/v1/pool-leases/{b['lease']}/renew", {}),
        ("pool_leases_release", "post", f"/v1/pool-leases/{b['lease']}/release", {}),
        ("quotas_retrieve", "get", "/v1/quotas/b-api", None),
        ("quotas_take", "post", "/v1/quotas/b-api/take", {"runId": b["run"]}),
        ("budgets_create", "post", f"/v1/runs/{b['run']}/budgets", {"name": "usd", "limit": 5}),
        ("budgets_retrieve", "get", f"/v1/budgets/{b['budget']}", None),
        ("budgets_set_limit", "patch", f"/v1/budgets/{b['budget']}", {"limit": 1}),
        (
            "budget_reservations_create",
            "post",
            "/v1/budget-reservations",
            {"runId": b["run"], "budget": "usd", "amount": 1},
        ),
        ("budget_reservations_retrieve", "get", f"/v1/budget-reservations/{b['reservation']}", None),
        ("budget_reservations_commit", "post", f"/v1/budget-reservations/{b['reservation']}/commit", {"amount": 1}),
        ("budget_reservations_release", "post", f"/v1/budget-reservations/{b['reservation']}/release", {}),
    ]


def per_item_cases(b):
    """Batch operations on claims answer 200 with a per-item ``NOT_FOUND`` for a claim not theirs."""
    return [
        ("claims_complete_batch", "/v1/claims/complete", {"items": [{"claimId": b["claim"], "outcome": 1}]}),
        ("claims_renew_batch", "/v1/claims/renew", {"items": [{"claimId": b["claim"]}]}),
    ]


def call(client, method, path, body):
    return getattr(client, method)(path, body, format="json") if body is not None else getattr(client, method)(path)


def assert_per_item_not_found(client, b, entered=lambda operation, method, path: nullcontext()):
    for operation, path, body in per_item_cases(b):
        with entered(operation, "post", path):
            response = client.post(path, body, format="json")
        assert response.status_code == 200, (operation, response.status_code, response.content[:300])
        (result,) = response.json()["results"]
        assert result["ok"] is False and result["error"]["code"] == "NOT_FOUND", (operation, result)


def schema_operations(client):
    schema = client.get("/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    return {op["operationId"] for ops in schema["paths"].values() for op in ops.values()}


def snapshot(project_id):
    """The state of everything project B owns."""
    return {
        model.__name__: sorted(
            (str(pk), state) for pk, state in model.objects.filter(project_id=project_id).values_list("id", field)
        )
        for model, field in [
            (Run, "stored_state"),
            (Task, "state"),
            (Message, "state"),
            (TaskGroup, "state"),
            (Barrier, "state"),
            (Timer, "state"),
        ]
    }


# The hot path's transport: how each operation it serves ends on B's ids (``hot.SERVED``).
# ``careful``: it read and counted the request, ran its statement (a wait: its first read),
# which found no row of A's (B's claim, task, group, barrier or timer), and handed it to the
# view in one thread hop; ``declined``: it handed it over before anything, as the fallback
# rule says of a run the key cannot see (B's, though the process holds its ref).
HOT_FOREIGN = {
    "barriers_wait": "careful",
    "claims_complete": "careful",
    "claims_fail": "careful",
    "claims_release": "careful",
    "claims_renew": "careful",
    "claims_complete_batch": "careful",
    "claims_renew_batch": "careful",
    "claims_create": "declined",
    "events_list": "declined",
    "events_stream": "declined",  # B's run, cached: not A's (the view answers its 404)
    "groups_wait": "careful",
    "tasks_result": "careful",
    "tasks_submit": "declined",
    "tasks_submit_batch": "declined",
    "timers_wait": "careful",
}

# The control: A's own submit, with the same key and mailbox, which the hot path serves itself
# (so a ``declined`` above is B's run's doing, not something the cache lacked).
OWN_SUBMIT = "tasks_submit on A's own run"
HOT_OWN = {OWN_SUBMIT: "Submit"}

TRANSPORTS = [
    "drf",
    pytest.param("hot", marks=[pytest.mark.django_db(transaction=True), pytest.mark.postgres_only]),
]


@pytest.fixture
def foreign_caller(request, transport, project, other_project, api, a, b):
    """A's client for the foreign-project column, and a check of what the hot path did with each request.

    ``drf``: the ``api`` test client; the hot path never sees its requests. ``hot``: the ASGI
    application with the hot path on, A's key and mailbox cached and B's run too (one process
    serves both projects), as a running API process holds them.
    """
    if transport == "drf":
        yield api, lambda served, operation, endpoint: served == Counter()
        return
    request.getfixturevalue("api_process")
    client = AsgiClient(_cached_key(project, permissions=ALL_PERMISSIONS))
    mailbox_get(project_id=project.id, name="jobs")
    selectors.run_ref(selectors.Visibility(project_id=project.id), a["run"])
    selectors.run_ref(selectors.Visibility(project_id=other_project.id), b["run"])

    def as_expected(served, operation, endpoint):
        if endpoint is None:
            return served == Counter()
        return served == Counter({{**HOT_FOREIGN, **HOT_OWN}[operation]: 1})

    try:
        yield client, as_expected
    finally:
        client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_operation_answers_404_for_another_projects_ids(api, a, b, other_project, transport, foreign_caller):
    client, as_expected = foreign_caller
    matrix = cases(a, b)
    covered = {operation for operation, *_ in matrix} | {operation for operation, *_ in per_item_cases(b)}
    assert covered | set(NO_FOREIGN_IDS) == schema_operations(api), "the isolation matrix is out of date"
    sent = [(operation, method, path) for operation, method, path, _ in matrix]
    sent += [(operation, "post", path) for operation, path, _ in per_item_cases(b)]
    endpoints = {operation: hot_endpoint(method, path) for operation, method, path in sent}
    hot_views = {operation: endpoint.view for operation, endpoint in endpoints.items() if endpoint is not None}
    assert set(hot_views) == set(HOT_FOREIGN), "HOT_FOREIGN is out of date"
    assert set(hot_views.values()) == set(hot.ENDPOINTS), "an endpoint of the hot path is not in the matrix"

    @contextmanager
    def entered(operation, method, path):
        before = Counter(hot.SERVED)
        yield
        served = Counter(hot.SERVED)
        served.subtract(before)
        served = +served
        assert as_expected(served, operation, hot_endpoint(method, path)), (operation, dict(served))

    before = snapshot(other_project.id)
    for operation, method, path, body in matrix:
        with entered(operation, method, path):
            response = call(client, method, path, body)
        assert response.status_code == 404, (operation, response.status_code, response.content[:300])
        assert response.json()["error"]["code"] == "NOT_FOUND", operation
    assert_per_item_not_found(client, b, entered)
    assert snapshot(other_project.id) == before, "a refused call changed another project's objects"
    with entered(OWN_SUBMIT, "post", "/v1/mailboxes/jobs/tasks"):
        response = call(client, "post", "/v1/mailboxes/jobs/tasks", {"runId": a["run"], "input": {}})
    assert response.status_code == 201, response.content[:300]


def test_lists_never_show_another_projects_objects(api, a, b):
    listed = {run["id"] for run in api.get("/v1/runs?limit=1000").json()["results"]}
    assert b["run"] not in listed
    events = api.get("/v1/events?limit=1000").json()["events"]
    foreign = set(b.values())
    assert not [e for e in events if e["subjectId"] in foreign or e["runId"] in foreign]


# The bound-key column ------------------------------------------------------------------------

# Operations that reach the whole project: a key bound to a run gets 403 PERMISSION_DENIED,
# whatever the name or body, and nothing changes. (operationId, method, path, body)
BOUND_PROJECT_WIDE = [
    ("mailboxes_ensure", "put", "/v1/mailboxes/jobs", {"mode": "WORK", "leaseTtlMs": 1000, "maxAttempts": 1}),
    ("pools_put", "put", "/v1/pools/b-gpu", {"capacity": 1}),
    ("quotas_put", "put", "/v1/quotas/b-api", {"limit": 1, "periodMs": 86_400_000}),
    ("quotas_retrieve", "get", "/v1/quotas/b-api", None),  # a bucket's level is the whole project's use
    ("runs_create", "post", "/v1/runs", {}),  # a root run (with a parent outside: 404, in ``cases``)
    ("groups_create", "post", "/v1/groups", {"mailbox": "jobs", "condition": "ALL_TERMINAL"}),  # a root gate
    ("metrics", "get", "/v1/metrics", None),  # every series is the whole project's
]

# Of those, the ones whose call in ``cases`` names no run: refused inside the subtree as well.
PROJECT_WIDE_ONLY = {"quotas_retrieve", "metrics"}

# Operations open to a bound key that take no object of a run, and why that is safe.
BOUND_OPEN = {
    "healthz": "no key, no data",
    "readyz": "no key, no data",
    "mailboxes_retrieve": "a mailbox's settings (mode, lease TTL, attempts), which a bound worker reads; no usage",
    "pools_retrieve": "answered with the subtree's share of the pool's use only (asserted below)",
    "claims_watch": "an endless stream of the key's subtree's events only (tests/api/test_claim_watch.py, a bound key)",
}

# Operations whose call inside the subtree the column does not make, and why.
NOT_CALLED_INSIDE = {
    "events_stream": "an endless stream; a bound key's stream is tested in tests/api/test_events.py",
}


@pytest.mark.django_db(transaction=True)  # the long-polls inside the subtree read through other connections
def test_a_key_bound_to_a_run_keeps_to_its_subtree(api, project):
    """The same matrix inside one project, with a key bound to run ``mine``.

    A sibling's objects are 404, project-wide operations 403 with nothing changed, and the
    same calls on the objects of ``mine``'s subtree are allowed (answered by the service:
    never 403 or 404, a conflict of state at most).
    """
    pid = project.id
    parent = run_create(project_id=pid)
    mine = run_create(project_id=pid, parent_id=parent.id)
    below = run_create(project_id=pid, parent_id=mine.id)
    theirs = run_create(project_id=pid, parent_id=parent.id)
    mailbox_ensure(project_id=pid, name="jobs", mode="WORK")
    mailbox_ensure(project_id=pid, name="q", mode="QUEUE")
    mailbox_ensure(project_id=pid, name="b-only", mode="WORK")
    outside = objects_under(pid, theirs)
    inside = objects_under(pid, below)
    own_group = group_create(project_id=pid, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=mine.id)
    bound = make_client(project, run_id=mine.id)

    outside_cases = [
        case
        for case in cases({"group": str(own_group.id)}, outside)
        if case[0] not in BOUND_OPEN and case[0] not in PROJECT_WIDE_ONLY
    ]
    covered = (
        {operation for operation, *_ in outside_cases}
        | {operation for operation, *_ in per_item_cases(outside)}
        | {operation for operation, *_ in BOUND_PROJECT_WIDE}
        | set(BOUND_OPEN)
    )
    assert covered == schema_operations(api), "the bound-key column of the isolation matrix is out of date"

    before, settings_before = snapshot(pid), project_settings(pid)
    for operation, method, path, body in outside_cases:
        response = call(bound, method, path, body)
        assert response.status_code == 404, (operation, response.status_code, response.content[:300])
        assert response.json()["error"]["code"] == "NOT_FOUND", operation
    assert_per_item_not_found(bound, outside)
    for operation, method, path, body in BOUND_PROJECT_WIDE:
        response = call(bound, method, path, body)
        assert response.status_code == 403, (operation, response.status_code, response.content[:300])
        assert response.json()["error"]["code"] == "PERMISSION_DENIED", operation
    assert snapshot(pid) == before, "a refused call changed an object"
    assert project_settings(pid) == settings_before, "a refused call changed a project-wide setting"
    assert Task.objects.get(id=outside["task"]).state == "RUNNING", "a claim outside the bound key's subtree changed"

    # The open reads: a mailbox's settings; a pool's use counted in the subtree only.
    assert bound.get("/v1/mailboxes/b-only").status_code == 200
    assert api.get("/v1/pools/b-gpu").json()["inUse"] == 2
    assert bound.get("/v1/pools/b-gpu").json()["inUse"] == 1

    # Inside the subtree every call reaches the service; the run's own cancel and complete last.
    inside_cases = [
        case
        for case in cases({"group": str(own_group.id)}, inside)
        if case[0] not in NOT_CALLED_INSIDE and case[0] not in PROJECT_WIDE_ONLY
    ]
    inside_cases.sort(key=lambda case: case[0] in {"runs_cancel", "runs_complete"})
    for operation, method, path, body in inside_cases:
        response = call(bound, method, path, body)
        assert response.status_code not in (401, 403, 404) and response.status_code < 500, (
            operation,
            response.status_code,
            response.content[:300],
        )
    for operation, path, body in per_item_cases(inside):
        (result,) = bound.post(path, body, format="json").json()["results"]
        assert result.get("error", {}).get("code") != "NOT_FOUND", (operation, result)
