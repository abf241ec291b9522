"""The admin of quotas, budgets and reservations: use shown, limits changed through the services."""

import pytest
from django.urls import reverse

from coordination.models import Budget, BudgetReservation, Quota
from coordination.services.budgets import budget_create, reservation_create
from coordination.services.quotas import quota_put, quota_take
from coordination.services.runs import run_create

pytestmark = pytest.mark.django_db


def change_url(obj):
    return reverse(f"admin:coordination_{obj._meta.model_name}_change", args=[obj.pk])


@pytest.fixture
def run(project):
    return run_create(project_id=project.id)


def test_quota_pages_show_the_level_and_change_the_limit_through_the_service(admin_client, project, run):
    quota, _ = quota_put(project_id=project.id, name="openai", limit=10, period_ms=3_600_000)
    quota_take(project_id=project.id, run_id=run.id, name="openai", amount=4)
    listing = admin_client.get(reverse("admin:coordination_quota_changelist")).content.decode()
    assert "openai" in listing and "6 / 10" in listing
    response = admin_client.post(change_url(quota), {"limit": 5, "period_ms": 1000}, follow=True)
    assert response.status_code == 200
    quota = Quota.objects.get(id=quota.id)
    assert (quota.limit, quota.period_ms) == (5, 1000)
    assert quota.level_micro == 5_000_000  # the level, 6, capped at the new limit


def test_budget_pages_show_use_and_reservations_and_refuse_a_limit_below_use(admin_client, project, run):
    budget = budget_create(project_id=project.id, run_id=run.id, name="usd", limit=100)
    reservation = reservation_create(project_id=project.id, run_id=run.id, budget="usd", amount=30).reservation
    listing = admin_client.get(reverse("admin:coordination_budget_changelist")).content.decode()
    assert "30 / 100" in listing
    page = admin_client.get(change_url(budget)).content.decode()
    assert str(reservation.id) in page
    response = admin_client.post(change_url(budget), {"limit": 20}, follow=True)
    assert any("Limit not changed" in m.message for m in response.context["messages"])
    assert Budget.objects.get(id=budget.id).limit == 100
    admin_client.post(change_url(budget), {"limit": 40}, follow=True)
    assert Budget.objects.get(id=budget.id).limit == 40


def test_release_action_hands_reservations_back(admin_client, project, run):
    budget = budget_create(project_id=project.id, run_id=run.id, name="usd", limit=100)
    reservation = reservation_create(project_id=project.id, run_id=run.id, budget="usd", amount=30).reservation
    admin_client.post(
        reverse("admin:coordination_budgetreservation_changelist"),
        {"action": "release_selected", "_selected_action": [str(reservation.id)]},
        follow=True,
    )
    assert BudgetReservation.objects.get(id=reservation.id).state == "RELEASED"
    assert Budget.objects.get(id=budget.id).reserved == 0


def test_metrics_report_quota_levels_and_budget_remaining(anon, project, run):
    from tests.operator.test_metrics import scrape, value

    quota_put(project_id=project.id, name="openai", limit=10, period_ms=3_600_000)
    quota_take(project_id=project.id, run_id=run.id, name="openai", amount=3)
    budget_create(project_id=project.id, run_id=run.id, name="usd", limit=100)
    reservation_create(project_id=project.id, run_id=run.id, budget="usd", amount=30)
    samples = scrape(anon)
    assert value(samples, "runstate_quota_available", project=project.name, quota="openai") == 7
    assert value(samples, "runstate_budget_remaining", project=project.name, budget="usd", run=str(run.id)) == 70


def test_the_dashboard_shows_bucket_levels_and_budget_bars(admin_client, project, run):
    quota_put(project_id=project.id, name="openai", limit=10, period_ms=3_600_000)
    budget = budget_create(project_id=project.id, run_id=run.id, name="usd", limit=100)
    reservation_create(project_id=project.id, run_id=run.id, budget="usd", amount=30)
    html = admin_client.get("/admin/dashboard/").content.decode()
    assert 'data-quota="openai"' in html and "10 / 10" in html
    assert f'data-budget="{budget.id}"' in html and "0 + 30 / 100" in html
    panels = admin_client.get("/admin/dashboard/panels").json()["panels"]
    assert "0 + 30 / 100" in panels["quotas_budgets"]
