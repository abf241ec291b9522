"""Issue 25, finding 5: a staff user who may only view changes nothing through the admin.

Every action of every registered ModelAdmin is checked, so an action added later without a
permission fails here; the two actions the finding named (a pool lease's release, a budget
reservation's release) and the run's own confirmation view are also tried end to end.
"""

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.test import RequestFactory
from django.urls import reverse

from coordination.domain.states import RunState
from coordination.models import BudgetReservation, PoolLease, Run
from coordination.services.budgets import budget_create, reservation_create
from coordination.services.pools import pool_acquire, pool_put
from coordination.services.runs import run_create

pytestmark = pytest.mark.django_db


def every_action():
    """Yield ``(model admin, action name, action function)`` for every action of every registered admin."""
    for model_admin in admin.site._registry.values():
        for function, name, _ in model_admin._get_base_actions():
            yield model_admin, name, function


ACTIONS = [
    pytest.param(model_admin, name, function, id=f"{model_admin}.{name}")
    for model_admin, name, function in every_action()
]


@pytest.fixture
def viewer(db):
    """A staff user holding every ``view_*`` permission and nothing else."""
    user = User.objects.create_user("viewer", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__startswith="view_"))
    return User.objects.get(pk=user.pk)  # fresh: the permission cache is empty


@pytest.fixture
def viewer_client(client, viewer):
    client.force_login(viewer)
    return client


def test_the_admin_has_the_actions_this_test_knows_of():
    names = {name for _, name, _ in every_action()}
    # A floor, not the list: the parametrized tests below cover whatever is registered.
    assert {"release", "release_selected", "revoke_selected", "cancel_selected", "set_max_active"} <= names


@pytest.mark.parametrize(("model_admin", "name", "function"), ACTIONS)
def test_every_admin_action_declares_a_permission_beyond_view(model_admin, name, function):
    declared = set(getattr(function, "allowed_permissions", ()))
    assert declared - {"view"}, f"{model_admin}.{name} declares no permission that changes state"
    for permission in declared:
        assert hasattr(model_admin, f"has_{permission}_permission"), (model_admin, name, permission)


@pytest.mark.parametrize(("model_admin", "name", "function"), ACTIONS)
def test_no_action_is_offered_to_a_view_only_staff_user(model_admin, name, function, viewer):
    request = RequestFactory().get("/admin/")
    request.user = viewer
    assert model_admin.has_view_permission(request)  # the changelist is open to them...
    assert name not in model_admin.get_actions(request)  # ...its actions are not


def test_a_view_only_user_cannot_release_a_pool_lease(viewer_client, project):
    pool_put(project_id=project.id, name="gpu", capacity=1)
    run = run_create(project_id=project.id)
    lease = pool_acquire(project_id=project.id, name="gpu", run_id=run.id, units=1).lease
    changelist = reverse("admin:coordination_poollease_changelist")

    assert viewer_client.get(changelist).status_code == 200
    viewer_client.post(changelist, {"action": "release", "_selected_action": [str(lease.pk)]})

    assert PoolLease.objects.get(pk=lease.pk).state == "HELD"


def test_a_view_only_user_cannot_release_a_budget_reservation(viewer_client, project):
    run = run_create(project_id=project.id)
    budget_create(project_id=project.id, run_id=run.id, name="usd", limit=100)
    reservation = reservation_create(project_id=project.id, run_id=run.id, budget="usd", amount=30).reservation
    changelist = reverse("admin:coordination_budgetreservation_changelist")

    assert viewer_client.get(changelist).status_code == 200
    viewer_client.post(changelist, {"action": "release_selected", "_selected_action": [str(reservation.pk)]})

    assert BudgetReservation.objects.get(pk=reservation.pk).state == "RESERVED"


@pytest.mark.parametrize("verb", ["cancel", "complete"])
def test_a_view_only_user_cannot_end_a_run_through_its_confirmation_page(viewer_client, project, verb):
    run = run_create(project_id=project.id)
    url = reverse("admin:coordination_run_end", args=[run.pk, verb])

    assert viewer_client.get(url).status_code == 403
    assert viewer_client.post(url, {"confirm": "yes"}).status_code == 403

    assert Run.objects.get(pk=run.pk).stored_state == RunState.ACTIVE


def test_a_user_with_the_change_permission_still_gets_the_actions(project):
    user = User.objects.create_user("operator", password="x", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(codename__in=["view_poollease", "change_poollease", "view_budgetreservation"])
        | Permission.objects.filter(codename="change_budgetreservation")
    )
    request = RequestFactory().get("/admin/")
    request.user = User.objects.get(pk=user.pk)
    assert "release" in admin.site._registry[PoolLease].get_actions(request)
    assert "release_selected" in admin.site._registry[BudgetReservation].get_actions(request)
