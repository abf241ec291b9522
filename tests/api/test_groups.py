"""Task groups over HTTP: every row and definition of DESIGN.md "Task groups"."""

from datetime import UTC, datetime, timedelta

import pytest

from coordination.models import Event, Run, Task, TaskGroup
from coordination.services.claims import claim_complete, claim_fail, task_claim
from coordination.services.groups import groups_finalize_due
from tests.conftest import err

pytestmark = pytest.mark.django_db


class Swarm:
    """Drive one group through the API, with workers through the services."""

    def __init__(self, api, project, **create):
        self.api, self.project = api, project
        api.put("/v1/mailboxes/reviews", {"mode": "WORK"}, format="json")
        response = api.post("/v1/groups", {"mailbox": "reviews", **create}, format="json")
        assert response.status_code == 201, response.json()
        self.group = response.json()
        self.id = self.group["id"]

    def submit(self, i=None, key=None, expect=(201,)):
        body = {"input": {"draft": i}}
        if key is not None:
            body["key"] = key
        response = self.api.post(f"/v1/groups/{self.id}/members", body, format="json")
        assert response.status_code in expect, response.json()
        return response.json()

    def run_member(self, task_id, succeed=True):
        """Claim the member on the gate and finish it."""
        mailbox = TaskGroup.objects.get(id=self.id).mailbox
        claims = task_claim(project_id=self.project.id, mailbox=mailbox, run_id=self.group["scopeId"], max_claims=100)
        held = {str(c.task.id): c for c in claims}
        for other_id, claim in held.items():
            if other_id != task_id:
                from coordination.services.claims import claim_release

                claim_release(project_id=self.project.id, claim_id=claim.claim_id)
        claim = held[task_id]
        if succeed:
            return claim_complete(project_id=self.project.id, claim_id=claim.claim_id, outcome={"ok": task_id})
        return claim_fail(project_id=self.project.id, claim_id=claim.claim_id, error="bad")

    def verdict(self, task_id, verdict, expect=200):
        response = self.api.post(f"/v1/groups/{self.id}/members/{task_id}/{verdict}")
        assert response.status_code == expect, response.json()
        return response.json()

    def close(self):
        response = self.api.post(f"/v1/groups/{self.id}/close")
        assert response.status_code == 200, response.json()
        return response.json()

    def status(self):
        response = self.api.get(f"/v1/groups/{self.id}")
        assert response.status_code == 200, response.json()
        return response.json()


def future(seconds=3600):
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def pass_deadline(group_id):
    past = datetime.now(UTC) - timedelta(seconds=1)
    group = TaskGroup.objects.get(id=group_id)
    TaskGroup.objects.filter(id=group_id).update(deadline=past)
    Run.objects.filter(id=group.scope_id).update(deadline=past)
    Task.objects.filter(group_id=group_id).update(run_deadline=past)


# Create ----------------------------------------------------------------------------------


def test_create_makes_a_gate_run_under_the_parent(api, project):
    parent = api.post("/v1/runs", {}, format="json").json()
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=2, parentScopeId=parent["id"], name="drafts")
    group = swarm.group
    assert (group["state"], group["outcome"], group["members"]) == ("OPEN", None, [])
    assert group["parentScopeId"] == parent["id"] and group["name"] == "drafts"
    gate = api.get(f"/v1/runs/{group['scopeId']}").json()
    assert gate["parentId"] == parent["id"] and gate["effective"] == "ACTIVE"
    assert Event.objects.filter(type="group.created", subject_id=group["id"]).exists()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"condition": "N_ACCEPTED"}, "threshold"),
        ({"condition": "FIRST_ACCEPTED", "threshold": 2}, "threshold"),
        ({"condition": "N_ACCEPTED", "threshold": 101}, "threshold"),
        ({"condition": "N_ACCEPTED", "threshold": 3, "expectedMembers": 2}, "expectedMembers"),
        ({"condition": "ALL_TERMINAL", "expectedMembers": 0}, "expectedMembers"),
        ({"condition": "ALL_TERMINAL", "deadline": "2000-01-01T00:00:00Z"}, "deadline"),
        ({"condition": "SOMETIMES"}, "condition"),
    ],
)
def test_create_validates(api, body, field):
    api.put("/v1/mailboxes/reviews", {"mode": "WORK"}, format="json")
    error = err(api.post("/v1/groups", {"mailbox": "reviews", **body}, format="json"), 400, "VALIDATION_ERROR")
    assert field in error["details"]


def test_create_needs_an_existing_work_mailbox(api):
    err(api.post("/v1/groups", {"mailbox": "nope", "condition": "ALL_TERMINAL"}, format="json"), 404, "NOT_FOUND")
    api.put("/v1/mailboxes/q", {"mode": "QUEUE"}, format="json")
    err(api.post("/v1/groups", {"mailbox": "q", "condition": "ALL_TERMINAL"}, format="json"), 404, "NOT_FOUND")


def test_create_under_a_cancelled_parent_is_refused(api):
    api.put("/v1/mailboxes/reviews", {"mode": "WORK"}, format="json")
    parent = api.post("/v1/runs", {}, format="json").json()
    api.post(f"/v1/runs/{parent['id']}/cancel", {}, format="json")
    body = {"mailbox": "reviews", "condition": "ALL_TERMINAL", "parentScopeId": parent["id"]}
    err(api.post("/v1/groups", body, format="json"), 409, "SCOPE_CANCELLED")
    assert TaskGroup.objects.count() == 0


# FIRST_ACCEPTED --------------------------------------------------------------------------


def test_first_accepted_succeeds_on_the_first_accept_and_cancels_the_rest(api, project):
    swarm = Swarm(api, project, condition="FIRST_ACCEPTED")
    a, b, c = (swarm.submit(i) for i in range(3))
    assert a["groupState"] == "OPEN" and a["groupId"] == swarm.id and a["runId"] == swarm.group["scopeId"]
    swarm.run_member(a["id"])
    mailbox = TaskGroup.objects.get(id=swarm.id).mailbox
    (held,) = task_claim(project_id=project.id, mailbox=mailbox, run_id=swarm.group["scopeId"])
    verdict = swarm.verdict(a["id"], "accept")
    assert verdict == {
        "taskId": a["id"],
        "verdict": "ACCEPTED",
        "late": False,
        "groupState": "FINALIZED",
        "outcome": "SUCCESS",
        "outcomeReason": "first_accepted",
    }
    status = swarm.status()
    states = {m["taskId"]: m["state"] for m in status["members"]}
    assert states[a["id"]] == "SUCCEEDED"
    assert {states[b["id"]], states[c["id"]]} == {"CANCELLED"}
    assert api.get(f"/v1/runs/{swarm.group['scopeId']}").json()["storedState"] == "CANCELLED"
    # Work still held by a worker is refused from the finalize on.
    from coordination.domain import exceptions

    with pytest.raises(exceptions.ScopeCancelled):
        claim_complete(project_id=project.id, claim_id=held.claim_id, outcome=None)
    err(
        api.post("/v1/mailboxes/reviews/claims", {"runId": swarm.group["scopeId"]}, format="json"),
        409,
        "SCOPE_CANCELLED",
    )
    assert Event.objects.filter(type="group.finalized", subject_id=swarm.id).count() == 1


def test_first_accepted_closed_with_all_rejected_stays_sealed_until_its_deadline(api, project):
    swarm = Swarm(api, project, condition="FIRST_ACCEPTED", deadline=future())
    member = swarm.submit(1)
    swarm.run_member(member["id"])
    swarm.verdict(member["id"], "reject")
    assert swarm.close() == {"state": "SEALED", "outcome": None, "outcomeReason": None}
    assert swarm.status()["state"] == "SEALED"
    pass_deadline(swarm.id)
    status = swarm.status()  # a read past the deadline finalizes first
    assert (status["state"], status["outcome"], status["outcomeReason"]) == ("FINALIZED", "FAILURE", "deadline")


# N_ACCEPTED ------------------------------------------------------------------------------


def test_n_accepted_succeeds_at_threshold_even_while_open(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=2)
    members = [swarm.submit(i) for i in range(4)]
    for m in members[:2]:
        swarm.run_member(m["id"])
    assert swarm.verdict(members[0]["id"], "accept")["groupState"] == "OPEN"
    decided = swarm.verdict(members[1]["id"], "accept")
    assert (decided["groupState"], decided["outcome"], decided["outcomeReason"]) == (
        "FINALIZED",
        "SUCCESS",
        "threshold_reached",
    )
    assert [m["state"] for m in swarm.status()["members"][2:]] == ["CANCELLED", "CANCELLED"]


def test_n_accepted_is_unreachable_only_after_close(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=2)
    a, b = swarm.submit(1), swarm.submit(2)
    swarm.run_member(a["id"], succeed=False)
    swarm.run_member(b["id"])
    swarm.verdict(b["id"], "reject")
    # Open: failures and rejections do not fail it; more members may still come.
    assert swarm.status()["state"] == "OPEN"
    closed = swarm.close()
    assert closed == {"state": "FINALIZED", "outcome": "FAILURE", "outcomeReason": "threshold_unreachable"}
    assert swarm.close() == closed  # idempotent


def test_n_accepted_closed_waits_while_it_can_still_reach(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=2)
    a, b = swarm.submit(1), swarm.submit(2)
    swarm.run_member(a["id"])
    swarm.verdict(a["id"], "accept")
    assert swarm.close()["state"] == "SEALED"
    swarm.run_member(b["id"], succeed=False)
    status = swarm.status()
    assert (status["state"], status["outcomeReason"]) == ("FINALIZED", "threshold_unreachable")


def test_members_failing_while_open_do_not_count_after_close(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=1)
    failed = swarm.submit(1)
    swarm.run_member(failed["id"], succeed=False)
    good = swarm.submit(2)
    swarm.run_member(good["id"])
    decided = swarm.verdict(good["id"], "accept")
    assert (decided["outcome"], decided["outcomeReason"]) == ("SUCCESS", "threshold_reached")


# ALL_TERMINAL ----------------------------------------------------------------------------


def test_all_terminal_waits_for_the_verdict_of_each_success(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL")
    a, b = swarm.submit(1), swarm.submit(2)
    swarm.run_member(a["id"])
    swarm.run_member(b["id"], succeed=False)
    assert swarm.close()["state"] == "SEALED"  # a SUCCEEDED without a verdict is not finished
    decided = swarm.verdict(a["id"], "accept")
    # One accepted and one FAILED (not rejected) member: success.
    assert (decided["groupState"], decided["outcome"], decided["outcomeReason"]) == (
        "FINALIZED",
        "SUCCESS",
        "all_terminal",
    )


def test_all_terminal_with_a_rejection_fails(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL", expectedMembers=2)
    a = swarm.submit(1)
    b = swarm.submit(2)
    assert b["groupState"] == "SEALED"  # the submit that reaches expectedMembers closes the group
    swarm.run_member(a["id"])
    swarm.run_member(b["id"])
    swarm.verdict(a["id"], "accept")
    decided = swarm.verdict(b["id"], "reject")
    assert (decided["outcome"], decided["outcomeReason"]) == ("FAILURE", "all_terminal")


def test_all_terminal_with_nothing_accepted_fails(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL")
    a = swarm.submit(1)
    swarm.run_member(a["id"], succeed=False)
    assert swarm.close() == {"state": "FINALIZED", "outcome": "FAILURE", "outcomeReason": "all_terminal"}


# Membership ------------------------------------------------------------------------------


def test_expected_members_closes_and_later_submits_are_group_closed(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=1, expectedMembers=2)
    first = swarm.submit(1, key="k1")
    assert first["groupState"] == "OPEN"
    second = swarm.submit(2, key="k2")
    assert second["groupState"] == "SEALED"
    assert Event.objects.filter(type="group.closed", subject_id=swarm.id).count() == 1
    err(api.post(f"/v1/groups/{swarm.id}/members", {"input": {"draft": 3}}, format="json"), 409, "GROUP_CLOSED")
    again = swarm.submit(1, key="k1", expect=(200,))
    assert again["id"] == first["id"]
    err(
        api.post(f"/v1/groups/{swarm.id}/members", {"input": {"draft": 9}, "key": "k1"}, format="json"),
        409,
        "KEY_CONFLICT",
    )


def test_group_full_at_101(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL")
    for i in range(100):
        swarm.submit(i)
    error = err(api.post(f"/v1/groups/{swarm.id}/members", {"input": {}}, format="json"), 409, "GROUP_FULL")
    assert error["details"]["maxMembers"] == 100
    assert TaskGroup.objects.get(id=swarm.id).member_count == 100


def test_finalized_group_answers_group_closed_to_submits_and_joins(api, project):
    swarm = Swarm(api, project, condition="FIRST_ACCEPTED")
    a = swarm.submit(1, key="a")
    swarm.run_member(a["id"])
    swarm.verdict(a["id"], "accept")
    err(api.post(f"/v1/groups/{swarm.id}/members", {"input": {}}, format="json"), 409, "GROUP_CLOSED")
    loose = api.post(
        "/v1/mailboxes/reviews/tasks", {"runId": api.post("/v1/runs", {}, format="json").json()["id"]}, format="json"
    )
    err(api.post(f"/v1/groups/{swarm.id}/join", {"taskId": loose.json()["id"]}, format="json"), 409, "GROUP_CLOSED")
    assert swarm.submit(1, key="a", expect=(200,))["id"] == a["id"]


def test_join_adds_an_existing_task_and_cancels_it_on_finalize(api, project):
    swarm = Swarm(api, project, condition="FIRST_ACCEPTED")
    elsewhere = api.post("/v1/runs", {}, format="json").json()
    loose = api.post("/v1/mailboxes/reviews/tasks", {"runId": elsewhere["id"], "input": {"x": 1}}, format="json").json()
    joined = api.post(f"/v1/groups/{swarm.id}/join", {"taskId": loose["id"]}, format="json")
    assert joined.status_code == 200
    assert (joined.json()["groupId"], joined.json()["groupState"]) == (swarm.id, "OPEN")
    again = api.post(f"/v1/groups/{swarm.id}/join", {"taskId": loose["id"]}, format="json")
    assert again.status_code == 200 and again.json()["id"] == loose["id"]
    winner = swarm.submit(1)
    swarm.run_member(winner["id"])
    swarm.verdict(winner["id"], "accept")
    # The joined task lives on another run, and is cancelled all the same.
    assert api.get(f"/v1/tasks/{loose['id']}").json()["state"] == "CANCELLED"
    assert api.get(f"/v1/runs/{elsewhere['id']}").json()["effective"] == "ACTIVE"


def test_join_refusals(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL")
    other = Swarm(api, project, condition="ALL_TERMINAL")
    api.put("/v1/mailboxes/other", {"mode": "WORK"}, format="json")
    run = api.post("/v1/runs", {}, format="json").json()
    wrong_mailbox = api.post("/v1/mailboxes/other/tasks", {"runId": run["id"]}, format="json").json()
    error = err(
        api.post(f"/v1/groups/{swarm.id}/join", {"taskId": wrong_mailbox["id"]}, format="json"), 400, "VALIDATION_ERROR"
    )
    assert "taskId" in error["details"]
    member_of_other = other.submit(1)
    err(api.post(f"/v1/groups/{swarm.id}/join", {"taskId": member_of_other["id"]}, format="json"), 409, "INVALID_STATE")
    err(api.post(f"/v1/groups/{swarm.id}/join", {"taskId": "nope"}, format="json"), 404, "NOT_FOUND")


def test_a_plain_submit_to_the_gate_is_a_member(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL", expectedMembers=1)
    response = api.post("/v1/mailboxes/reviews/tasks", {"runId": swarm.group["scopeId"], "input": {}}, format="json")
    assert response.status_code == 201 and response.json()["groupId"] == swarm.id
    assert swarm.status()["state"] == "SEALED"


# Verdicts --------------------------------------------------------------------------------


def test_verdict_rules(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=2)
    a, b = swarm.submit(1), swarm.submit(2)
    err(api.post(f"/v1/groups/{swarm.id}/members/{a['id']}/accept"), 409, "TASK_NOT_SUCCEEDED")
    err(api.post(f"/v1/groups/{swarm.id}/members/{a['id']}/reject"), 409, "TASK_NOT_FINISHED")
    swarm.run_member(a["id"])
    first = swarm.verdict(a["id"], "accept")
    assert swarm.verdict(a["id"], "accept") == first  # idempotent
    err(api.post(f"/v1/groups/{swarm.id}/members/{a['id']}/reject"), 409, "VERDICT_CONFLICT")
    swarm.run_member(b["id"], succeed=False)
    err(api.post(f"/v1/groups/{swarm.id}/members/{b['id']}/accept"), 409, "TASK_NOT_SUCCEEDED")
    assert swarm.verdict(b["id"], "reject")["verdict"] == "REJECTED"
    err(api.post(f"/v1/groups/{swarm.id}/members/00000000-0000-7000-8000-000000000000/accept"), 404, "NOT_FOUND")
    assert Event.objects.filter(type="member.verdict").count() == 2


def test_late_verdicts_are_recorded_and_change_nothing(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=1)
    a, b = swarm.submit(1), swarm.submit(2)
    swarm.run_member(a["id"])
    swarm.run_member(b["id"])
    swarm.verdict(a["id"], "accept")
    late = swarm.verdict(b["id"], "reject")
    assert (late["late"], late["groupState"], late["outcome"]) == (True, "FINALIZED", "SUCCESS")
    members = {m["taskId"]: m for m in swarm.status()["members"]}
    assert (members[b["id"]]["verdict"], members[b["id"]]["late"]) == ("REJECTED", True)
    assert members[a["id"]]["late"] is False
    event = Event.objects.get(type="member.verdict", subject_id=b["id"])
    assert event.data["late"] is True and event.data["groupId"] == swarm.id


# Cancel, deadline, seal ------------------------------------------------------------------


def test_cancelling_the_parent_finalizes_failure_cancelled(api, project):
    parent = api.post("/v1/runs", {}, format="json").json()
    swarm = Swarm(api, project, condition="ALL_TERMINAL", parentScopeId=parent["id"])
    member = swarm.submit(1)
    api.post(f"/v1/runs/{parent['id']}/cancel", {}, format="json")
    status = swarm.status()
    assert (status["state"], status["outcome"], status["outcomeReason"]) == ("FINALIZED", "FAILURE", "cancelled")
    assert status["members"][0]["state"] == "CANCELLED"
    assert api.get(f"/v1/tasks/{member['id']}").json()["state"] == "CANCELLED"


def test_deadline_sweep_finalizes_and_cancels_members(api, project):
    swarm = Swarm(api, project, condition="N_ACCEPTED", threshold=1, deadline=future())
    member = swarm.submit(1)
    pass_deadline(swarm.id)
    assert groups_finalize_due() == 1
    group = TaskGroup.objects.get(id=swarm.id)
    assert (group.state, group.outcome, group.outcome_reason) == ("FINALIZED", "FAILURE", "deadline")
    assert Task.objects.get(id=member["id"]).state == "CANCELLED"
    assert groups_finalize_due() == 0


def test_submit_past_the_deadline_finalizes_then_answers_group_closed(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL", deadline=future())
    pass_deadline(swarm.id)
    err(api.post(f"/v1/groups/{swarm.id}/members", {"input": {}}, format="json"), 409, "GROUP_CLOSED")
    assert TaskGroup.objects.get(id=swarm.id).outcome_reason == "deadline"


def test_seal_is_close_but_conflicts_on_a_finalized_group(api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL")
    assert api.post(f"/v1/groups/{swarm.id}/seal").json() == {
        "state": "FINALIZED",
        "outcome": "FAILURE",
        "outcomeReason": "all_terminal",
    }
    err(api.post(f"/v1/groups/{swarm.id}/seal"), 409, "GROUP_FINALIZED")
    assert api.post(f"/v1/groups/{swarm.id}/close").json()["state"] == "FINALIZED"


def test_another_projects_group_is_not_found(api, other_api, project):
    swarm = Swarm(api, project, condition="ALL_TERMINAL")
    for response in (
        other_api.get(f"/v1/groups/{swarm.id}"),
        other_api.post(f"/v1/groups/{swarm.id}/close"),
        other_api.post(f"/v1/groups/{swarm.id}/members", {"input": {}}, format="json"),
        other_api.get(f"/v1/groups/{swarm.id}/wait"),
    ):
        err(response, 404, "NOT_FOUND")
