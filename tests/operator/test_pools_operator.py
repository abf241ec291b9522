"""Pools where an operator looks: the admin (capacity through the service), metrics and the dashboard."""

import pytest
from django.urls import reverse

from coordination.models import Pool, PoolLease
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.runs import run_create
from tests.operator.test_metrics import scrape, value

pytestmark = pytest.mark.django_db(transaction=True)

POOLS = reverse("admin:coordination_pool_changelist")
LEASES = reverse("admin:coordination_poollease_changelist")


@pytest.fixture
def busy(project):
    """Pool ``gpu`` (capacity 2) with 2 units held and one waiter for 1 unit."""
    pool, _ = pool_put(project_id=project.id, name="gpu", capacity=2)
    run = run_create(project_id=project.id)
    held = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=2).lease
    waiter = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=1, wait_ms=30_000).lease
    return pool, held, waiter


def test_the_admin_lists_each_pool_with_capacity_use_and_waiters(admin_client, busy):
    response = admin_client.get(POOLS)
    assert response.status_code == 200
    row = next(r for r in response.context["cl"].result_list if r.name == "gpu")
    admin = response.context["cl"].model_admin
    assert (row.capacity, admin.in_use_now(row), admin.waiting_now(row)) == (2, 2, 1)


def test_growing_the_capacity_in_the_admin_grants_the_waiter(admin_client, busy, project):
    pool, _, waiter = busy
    url = reverse("admin:coordination_pool_change", args=[pool.pk])
    response = admin_client.post(url, {"capacity": 3}, follow=True)
    assert response.status_code == 200
    assert Pool.objects.get(id=pool.id).capacity == 3
    assert PoolLease.objects.get(id=waiter.id).state == "HELD"  # pool_put granted it
    assert Pool.objects.get(id=pool.id).in_use == 3


def test_the_admin_creates_a_pool_through_the_service(admin_client, project):
    response = admin_client.post(
        reverse("admin:coordination_pool_add"), {"project": project.pk, "name": "browsers", "capacity": 5}, follow=True
    )
    assert response.status_code == 200
    assert Pool.objects.get(project=project, name="browsers").capacity == 5


def test_the_release_action_hands_units_back_and_grants_the_waiter(admin_client, busy):
    pool, held, waiter = busy
    response = admin_client.post(LEASES, {"action": "release", "_selected_action": [str(held.pk)]}, follow=True)
    assert response.status_code == 200
    assert PoolLease.objects.get(id=held.id).state == "RELEASED"
    assert PoolLease.objects.get(id=waiter.id).state == "HELD"


def test_metrics_show_each_pools_use_and_queue(anon, busy, project):
    samples = scrape(anon)
    labels = {"project": project.name, "pool": "gpu"}
    assert value(samples, "runstate_pool_in_use", **labels) == 2
    assert value(samples, "runstate_pool_waiting", **labels) == 1
    assert value(samples, "runstate_pool_capacity", **labels) == 2


def test_the_dashboard_has_a_pools_panel(admin_client, busy):
    panels = admin_client.get("/admin/dashboard/panels").json()["panels"]
    assert 'data-pool="gpu"' in panels["pools"]
    assert "2</a> / 2" in panels["pools"]


def test_the_admin_refuses_a_bad_name_or_capacity_in_the_form(admin_client, project):
    response = admin_client.post(
        reverse("admin:coordination_pool_add"), {"project": project.pk, "name": "bad name", "capacity": 0}
    )
    assert response.status_code == 200  # the form again, with its errors
    assert set(response.context["adminform"].form.errors) == {"name", "capacity"}
    assert not Pool.objects.exists()
