"""Every operation of the schema, called with project A's key on project B's ids: 404, never 403 or 200.

The matrix is checked against /v1/schema, so a new endpoint fails this test until it is
listed here (in ``CASES`` or, with a reason, in ``NO_FOREIGN_IDS``).
"""

import pytest

from coordination.models import Barrier, Message, Run, Task, TaskGroup, Timer
from coordination.services.admissions import admission_request
from coordination.services.barriers import barrier_create
from coordination.services.budgets import budget_create, reservation_create
from coordination.services.claims import task_claim
from coordination.services.groups import group_create, group_submit
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.messages import message_receive, message_send
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.quotas import quota_put
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit
from coordination.services.timers import timer_create
from tests.conftest import make_client

pytestmark = pytest.mark.django_db

# Operations that take no id of another project's object, and why they cannot leak.
NO_FOREIGN_IDS = {
    "healthz": "no data",
    "readyz": "no data",
    "metrics": "takes no id; a key's scrape is its own project's series (tests/operator/test_metrics_access.py)",
    "mailboxes_ensure": "mailbox names are per project: ensuring B's name creates A's own mailbox",
    "pools_put": "pool names are per project: putting B's name creates A's own pool",
    "quotas_put": "quota names are per project: putting B's name creates A's own quota",
}


@pytest.fixture
def b(other_project):
    """Project B's objects: a run tree, mailboxes, a task held under a claim, a delivery, a group..."""
    pid = other_project.id
    run = run_create(project_id=pid)
    jobs, _ = mailbox_ensure(project_id=pid, name="jobs", mode="WORK")
    queue, _ = mailbox_ensure(project_id=pid, name="q", mode="QUEUE")
    mailbox_ensure(project_id=pid, name="b-only", mode="WORK")
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
    """Project B's pool ``b-gpu`` (A has no pool of that name) and a lease held on it; also B's quota ``b-api``."""
    pool_put(project_id=project_id, name="b-gpu", capacity=1)
    quota_put(project_id=project_id, name="b-api", limit=10, period_ms=1000)
    return str(pool_acquire(project_id=project_id, name="b-gpu", run_id=run_id).lease.id)


@pytest.fixture
def a(project, api):
    """Project A's own mailboxes and group, so that the foreign id is the only thing wrong."""
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    mailbox_ensure(project_id=project.id, name="q", mode="QUEUE")
    run = run_create(project_id=project.id)
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=run.id)
    return {"group": str(group.id)}


def cases(a, b):
    """(operationId, method, path, body) with B's ids in every id slot."""
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
        ("timers_wait", "post", f"/v1/timers/{b['timer']}/wait?timeoutMs=0", {}),
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


def assert_per_item_not_found(client, b):
    for operation, path, body in per_item_cases(b):
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


def test_every_operation_answers_404_for_another_projects_ids(api, a, b, other_project):
    matrix = cases(a, b)
    covered = {operation for operation, *_ in matrix} | {operation for operation, *_ in per_item_cases(b)}
    assert covered | set(NO_FOREIGN_IDS) == schema_operations(api), "the isolation matrix is out of date"
    before = snapshot(other_project.id)
    for operation, method, path, body in matrix:
        response = getattr(api, method)(path, body, format="json") if body is not None else api.get(path)
        assert response.status_code == 404, (operation, response.status_code, response.content[:300])
        assert response.json()["error"]["code"] == "NOT_FOUND", operation
    assert_per_item_not_found(api, b)
    assert snapshot(other_project.id) == before, "a refused call changed another project's objects"


def test_lists_never_show_another_projects_objects(api, a, b):
    listed = {run["id"] for run in api.get("/v1/runs?limit=1000").json()["results"]}
    assert b["run"] not in listed
    events = api.get("/v1/events?limit=1000").json()["events"]
    foreign = set(b.values())
    assert not [e for e in events if e["subjectId"] in foreign or e["runId"] in foreign]


def test_a_key_bound_to_a_run_gets_404_outside_its_subtree(project, a, b):
    """The same matrix inside one project: a key bound to a sibling run sees none of it."""
    pid = project.id
    parent = run_create(project_id=pid)
    mine = run_create(project_id=pid, parent_id=parent.id)
    theirs = run_create(project_id=pid, parent_id=parent.id)
    jobs = mailbox_ensure(project_id=pid, name="jobs", mode="WORK")[0]
    queue = mailbox_ensure(project_id=pid, name="q", mode="QUEUE")[0]
    task_submit(project_id=pid, mailbox=jobs, run_id=theirs.id, input={})
    (claim,) = task_claim(project_id=pid, mailbox=jobs, run_id=theirs.id)
    message_send(project_id=pid, mailbox=queue, run_id=theirs.id, body={})
    (delivery,) = message_receive(project_id=pid, mailbox=queue, run_id=theirs.id)
    group = group_create(project_id=pid, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=theirs.id)
    member, _, _ = group_submit(project_id=pid, group_id=group.id, input={})
    own_group = group_create(project_id=pid, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=mine.id)
    outside = {
        "run": str(theirs.id),
        "task": str(claim.task.id),
        "claim": claim.claim_id,
        "message": str(delivery.message.id),
        "delivery": delivery.delivery_id,
        "group": str(group.id),
        "member": str(member.id),
        "barrier": str(barrier_create(project_id=pid, run_id=theirs.id, target=2).id),
        "timer": str(timer_create(project_id=pid, run_id=theirs.id, after_seconds=600).id),
        "admission": str(admission_request(project_id=pid, run_id=theirs.id).admission.id),
        "lease": _pool_lease(pid, theirs.id),
        "budget": str(budget_create(project_id=pid, run_id=theirs.id, name="usd", limit=100).id),
        "reservation": str(reservation_create(project_id=pid, run_id=theirs.id, budget="usd", amount=1).reservation.id),
    }
    bound = make_client(project, run_id=mine.id)
    # Mailboxes, pools and quotas belong to the project, not to a run: a bound key reads them,
    # and uses them only for runs of its subtree (pools_acquire, quotas_take are in the matrix).
    skip = {"mailboxes_retrieve", "pools_retrieve", "quotas_retrieve"}
    for operation, method, path, body in cases({"group": str(own_group.id)}, outside):
        if operation in skip:
            continue
        response = getattr(bound, method)(path, body, format="json") if body is not None else bound.get(path)
        assert response.status_code == 404, (operation, response.status_code, response.content[:300])
    assert_per_item_not_found(bound, outside)
    assert Task.objects.get(id=claim.task.id).state == "RUNNING", "a claim outside the bound key's subtree changed"
