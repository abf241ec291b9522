"""The admin of admissions: each run's limit with admitted and waiting, the line, and the actions."""

import pytest
from django.contrib import messages
from django.urls import reverse

from coordination.models import Admission, AdmissionConfig, Event
from coordination.services.admissions import admission_configure, admission_request
from coordination.services.runs import run_create

pytestmark = pytest.mark.django_db

CONFIGS = reverse("admin:coordination_admissionconfig_changelist")
ADMISSIONS = reverse("admin:coordination_admission_changelist")


def change_url(obj):
    return reverse(f"admin:coordination_{obj._meta.model_name}_change", args=[obj.pk])


def messages_of(response):
    return [(message.level, message.message) for message in response.context["messages"]]


@pytest.fixture
def line(project):
    """A run with maxActive 1: one admitted, two waiting."""
    parent = run_create(project_id=project.id, name="job")
    config, _ = admission_configure(project_id=project.id, run_id=parent.id, max_active=1)
    answers = [admission_request(project_id=project.id, run_id=parent.id, name=f"a{i}") for i in range(3)]
    return config, [answer.admission for answer in answers]


def test_config_list_and_page_show_admitted_waiting_and_the_line(admin_client, line):
    config, (first, second, third) = line
    page = admin_client.get(CONFIGS).content.decode()
    assert str(config.run_id) in page
    detail = admin_client.get(change_url(config)).content.decode()
    assert str(first.id) in detail and str(second.id) in detail and str(third.id) in detail
    assert detail.count("WAITING") >= 2 and "ADMITTED" in detail


def test_set_max_active_action_asks_then_admits_the_waiters_that_fit(admin_client, line):
    config, (_, second, third) = line
    body = {"action": "set_max_active", "_selected_action": [str(config.pk)]}
    form = admin_client.post(CONFIGS, body)
    assert form.status_code == 200 and b"maxActive" in form.content
    done = admin_client.post(CONFIGS, {**body, "apply": "1", "max_active": "2"}, follow=True)
    assert any(level == messages.SUCCESS for level, _ in messages_of(done))
    config.refresh_from_db()
    assert (config.max_active, config.admitted, config.waiting) == (2, 2, 1)
    assert Admission.objects.get(id=second.id).state == "ADMITTED"
    assert Admission.objects.get(id=third.id).state == "WAITING"


def test_withdraw_action_withdraws_waiters_and_skips_the_admitted(admin_client, line):
    config, (first, second, third) = line
    body = {"action": "withdraw_selected", "_selected_action": [str(a.pk) for a in (first, second)]}
    response = admin_client.post(ADMISSIONS, body, follow=True)
    levels = {level for level, _ in messages_of(response)}
    assert levels == {messages.SUCCESS, messages.INFO}
    assert Admission.objects.get(id=first.id).state == "ADMITTED"
    assert Admission.objects.get(id=second.id).state == "WITHDRAWN"
    assert Event.objects.filter(type="admission.withdrawn", subject_id=str(second.id)).count() == 1
    assert AdmissionConfig.objects.get(id=config.id).waiting == 1


def test_admissions_cannot_be_added_changed_or_deleted(admin_client, line):
    config, (first, *_) = line
    assert admin_client.get(reverse("admin:coordination_admission_add")).status_code == 403
    assert admin_client.post(change_url(first), {"state": "WITHDRAWN"}).status_code == 403
    assert admin_client.get(reverse("admin:coordination_admissionconfig_add")).status_code == 403
    search = admin_client.get(ADMISSIONS, {"q": str(first.id)}).content.decode()
    assert str(first.id) in search
