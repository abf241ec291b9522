"""Budgets over HTTP: DESIGN.md "Shared limits" (budgets)."""

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from coordination.models import Budget, BudgetReservation, Event
from coordination.services.budgets import reservations_expire_due
from tests.conftest import err, make_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(api):
    return api.post("/v1/runs", {}, format="json").json()


def child_of(api, run):
    return api.post(f"/v1/runs/{run['id']}/children", {}, format="json").json()


def create(api, run, name="usd", limit=100):
    response = api.post(f"/v1/runs/{run['id']}/budgets", {"name": name, "limit": limit}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def reserve(api, run, amount, budget="usd", **extra):
    return api.post(
        "/v1/budget-reservations", {"runId": run["id"], "budget": budget, "amount": amount, **extra}, format="json"
    )


def budget(api, view):
    return api.get(f"/v1/budgets/{view['id']}").json()


def test_create_answers_the_view(api, run):
    response = api.post(f"/v1/runs/{run['id']}/budgets", {"name": "usd", "limit": 100}, format="json")
    assert response.status_code == 201
    view = response.json()
    assert response["Location"] == f"/v1/budgets/{view['id']}"
    assert {k: view[k] for k in ("runId", "name", "limit", "spent", "reserved", "remaining")} == {
        "runId": run["id"],
        "name": "usd",
        "limit": 100,
        "spent": 0,
        "reserved": 0,
        "remaining": 100,
    }
    assert budget(api, view) == view
    err(api.post(f"/v1/runs/{run['id']}/budgets", {"name": "usd", "limit": 5}, format="json"), 409, "KEY_CONFLICT")


def test_reserve_commit_release(api, run):
    usd = create(api, run)
    response = reserve(api, run, 30)
    assert response.status_code == 201
    first = response.json()
    assert (first["amount"], first["state"], first["budget"]) == (30, "RESERVED", "usd")
    assert response["Location"] == f"/v1/budget-reservations/{first['reservationId']}"
    assert budget(api, usd)["reserved"] == 30
    committed = api.post(f"/v1/budget-reservations/{first['reservationId']}/commit", {"amount": 12}, format="json")
    assert committed.json()["state"] == "COMMITTED" and committed.json()["committed"] == 12
    assert (budget(api, usd)["spent"], budget(api, usd)["reserved"], budget(api, usd)["remaining"]) == (12, 0, 88)
    again = api.post(f"/v1/budget-reservations/{first['reservationId']}/commit", {"amount": 1}, format="json")
    err(again, 409, "INVALID_STATE")
    # Release of a settled reservation answers it unchanged.
    assert api.post(f"/v1/budget-reservations/{first['reservationId']}/release").json()["state"] == "COMMITTED"
    second = reserve(api, run, 50).json()
    released = api.post(f"/v1/budget-reservations/{second['reservationId']}/release")
    assert released.status_code == 200 and released.json()["state"] == "RELEASED"
    assert api.post(f"/v1/budget-reservations/{second['reservationId']}/release").json()["state"] == "RELEASED"
    err(
        api.post(f"/v1/budget-reservations/{second['reservationId']}/commit", {"amount": 0}, format="json"),
        409,
        "INVALID_STATE",
    )
    assert budget(api, usd)["remaining"] == 88
    types = [e.type for e in Event.objects.filter(type__startswith="budget.").order_by("id")]
    assert types == ["budget.reserved", "budget.committed", "budget.reserved", "budget.released"]
    assert Event.objects.filter(type="budget.committed").get().subject_id == first["reservationId"]


def test_a_commit_above_the_reservation_is_a_validation_error(api, run):
    create(api, run)
    reservation = reserve(api, run, 10).json()
    url = f"/v1/budget-reservations/{reservation['reservationId']}/commit"
    err(api.post(url, {"amount": 11}, format="json"), 400, "VALIDATION_ERROR")
    assert api.post(url, {"amount": 10}, format="json").status_code == 200


def test_exhausted_names_the_tightest_budget_of_the_chain(api, run):
    child = child_of(api, run)
    parent_budget = create(api, run, limit=100)
    child_budget = create(api, child, limit=50)
    assert reserve(api, child, 40).status_code == 201
    error = err(reserve(api, child, 20), 409, "BUDGET_EXHAUSTED")
    assert error["details"] == {"remaining": 10, "budgetId": child_budget["id"], "runId": child["id"]}
    # All or nothing: the refused reservation left nothing on the parent.
    assert budget(api, parent_budget)["reserved"] == 40
    assert reserve(api, run, 60).status_code == 201
    error = err(reserve(api, child, 5), 409, "BUDGET_EXHAUSTED")
    assert error["details"] == {"remaining": 0, "budgetId": parent_budget["id"], "runId": run["id"]}
    exhausted = Event.objects.filter(type="budget.exhausted").order_by("id")
    # An ancestor's budget is not named in the reserving run's event (bound keys read it).
    assert [e.subject_id for e in exhausted] == [child_budget["id"], ""]


def test_a_bound_key_does_not_learn_about_budgets_above_its_binding(project, api, run):
    child = child_of(api, run)
    parent_budget = create(api, run, limit=10)
    bound = make_client(project, run_id=child["id"])
    error = err(reserve(bound, child, 11), 409, "BUDGET_EXHAUSTED")
    assert error["details"] == {"remaining": 10}
    err(bound.get(f"/v1/budgets/{parent_budget['id']}"), 404, "NOT_FOUND")
    own = create(bound, child, limit=5)
    assert bound.get(f"/v1/budgets/{own['id']}").status_code == 200
    err(bound.post(f"/v1/runs/{run['id']}/budgets", {"name": "x", "limit": 1}, format="json"), 404, "NOT_FOUND")
    reservation = reserve(api, run, 1).json()
    err(bound.post(f"/v1/budget-reservations/{reservation['reservationId']}/release"), 404, "NOT_FOUND")


def test_a_name_without_budget_on_the_chain_is_not_found(api, run):
    child = child_of(api, run)
    create(api, child, name="tokens")
    err(reserve(api, run, 1, budget="tokens"), 404, "NOT_FOUND")
    err(reserve(api, child, 1, budget="usd"), 404, "NOT_FOUND")


def test_a_key_makes_a_reservation_idempotent(api, run):
    usd = create(api, run)
    first = reserve(api, run, 10, key="call-1")
    again = reserve(api, run, 10, key="call-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["reservationId"] == again.json()["reservationId"]
    assert budget(api, usd)["reserved"] == 10
    err(reserve(api, run, 11, key="call-1"), 409, "KEY_CONFLICT")


def test_inactive_run_refuses_creates_and_reservations_but_settles(api, run):
    create(api, run)
    reservation = reserve(api, run, 10).json()
    child = child_of(api, run)
    api.post(f"/v1/runs/{run['id']}/cancel", {}, format="json")
    err(reserve(api, child, 1), 409, "SCOPE_CANCELLED")
    err(api.post(f"/v1/runs/{child['id']}/budgets", {"name": "eur", "limit": 1}, format="json"), 409, "SCOPE_CANCELLED")
    committed = api.post(f"/v1/budget-reservations/{reservation['reservationId']}/commit", {"amount": 4}, format="json")
    assert committed.status_code == 200


def test_expiry_returns_the_units(api, run):
    usd = create(api, run)
    reservation = reserve(api, run, 30, ttlMs=60_000).json()
    assert reservations_expire_due() == 0
    assert reservations_expire_due(now=timezone.now() + timedelta(minutes=2)) == 1
    view = budget(api, usd)
    assert (view["reserved"], view["remaining"]) == (0, 100)
    url = f"/v1/budget-reservations/{reservation['reservationId']}"
    assert api.get(url).json()["state"] == "EXPIRED"
    err(api.post(f"{url}/commit", {"amount": 1}, format="json"), 409, "INVALID_STATE")
    assert Event.objects.filter(type="budget.expired", subject_id=reservation["reservationId"]).count() == 1


def test_a_reservation_past_its_ttl_cannot_be_committed_before_the_sweep(api, run):
    create(api, run)
    reservation = reserve(api, run, 3, ttlMs=1).json()
    BudgetReservation.objects.filter(id=reservation["reservationId"]).update(expires_at=timezone.now())
    url = f"/v1/budget-reservations/{reservation['reservationId']}/commit"
    err(api.post(url, {"amount": 1}, format="json"), 409, "INVALID_STATE")


def test_the_database_refuses_an_overspent_budget(api, run):
    usd = create(api, run, limit=10)
    with pytest.raises(IntegrityError), transaction.atomic():
        Budget.objects.filter(id=usd["id"]).update(spent=6, reserved=5)


def test_isolation_across_projects(api, other_api, run):
    usd = create(api, run)
    reservation = reserve(api, run, 1).json()
    err(other_api.get(f"/v1/budgets/{usd['id']}"), 404, "NOT_FOUND")
    err(reserve(other_api, run, 1), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/budget-reservations/{reservation['reservationId']}/release"), 404, "NOT_FOUND")
    err(other_api.post(f"/v1/runs/{run['id']}/budgets", {"name": "x", "limit": 1}, format="json"), 404, "NOT_FOUND")


def test_validation_and_permissions(project, api, run):
    create(api, run)
    err(reserve(api, run, 0), 400, "VALIDATION_ERROR")
    err(reserve(api, run, 1, ttlMs=0), 400, "VALIDATION_ERROR")
    err(api.post(f"/v1/runs/{run['id']}/budgets", {"name": "x", "limit": -1}, format="json"), 400, "VALIDATION_ERROR")
    writer = make_client(project, permissions=["coordination_write"])
    err(
        writer.post(f"/v1/runs/{run['id']}/budgets", {"name": "x", "limit": 1}, format="json"), 403, "PERMISSION_DENIED"
    )
    assert reserve(writer, run, 1).status_code == 201


def test_the_limit_is_changed_through_the_api_but_never_below_what_is_spent_and_reserved(project, api, run):
    usd = create(api, run, limit=100)
    reservation = reserve(api, run, 30).json()
    api.post(f"/v1/budget-reservations/{reservation['reservationId']}/commit", {"amount": 20}, format="json")
    reserve(api, run, 25)  # spent 20 + reserved 25 = 45
    raised = api.patch(f"/v1/budgets/{usd['id']}", {"limit": 500}, format="json")
    assert raised.status_code == 200, raised.content
    assert {k: raised.json()[k] for k in ("limit", "spent", "reserved", "remaining")} == {
        "limit": 500,
        "spent": 20,
        "reserved": 25,
        "remaining": 455,
    }
    assert api.patch(f"/v1/budgets/{usd['id']}", {"limit": 45}, format="json").json()["remaining"] == 0
    error = err(api.patch(f"/v1/budgets/{usd['id']}", {"limit": 44}, format="json"), 400, "VALIDATION_ERROR")
    assert error["details"] == {"limit": "at least 45"}
    err(api.patch(f"/v1/budgets/{usd['id']}", {}, format="json"), 400, "VALIDATION_ERROR")
    err(api.patch(f"/v1/budgets/{usd['id']}", {"limit": -1}, format="json"), 400, "VALIDATION_ERROR")
    err(api.patch(f"/v1/budgets/{usd['id']}", {"limit": 50, "spent": 0}, format="json"), 400, "VALIDATION_ERROR")
    assert Budget.objects.get(id=usd["id"]).limit == 45


def test_changing_a_limit_needs_resource_config_and_a_visible_budget(project, api, other_api, run):
    usd = create(api, run, limit=100)
    writer = make_client(project, permissions=["coordination_write", "coordination_read"])
    err(writer.patch(f"/v1/budgets/{usd['id']}", {"limit": 5}, format="json"), 403, "PERMISSION_DENIED")
    err(other_api.patch(f"/v1/budgets/{usd['id']}", {"limit": 5}, format="json"), 404, "NOT_FOUND")
    elsewhere = api.post("/v1/runs", {}, format="json").json()
    bound = make_client(project, run_id=elsewhere["id"])
    err(bound.patch(f"/v1/budgets/{usd['id']}", {"limit": 5}, format="json"), 404, "NOT_FOUND")
    err(api.patch("/v1/budgets/not-an-id", {"limit": 5}, format="json"), 404, "NOT_FOUND")
    assert Budget.objects.get(id=usd["id"]).limit == 100
    # A key bound to the budget's own run changes it: the budget caps only that subtree.
    own = make_client(project, run_id=run["id"])
    assert own.patch(f"/v1/budgets/{usd['id']}", {"limit": 7}, format="json").json()["limit"] == 7
