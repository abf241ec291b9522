"""A task's admin page shows its trace id; ``RUNSTATE_TRACE_URL`` makes it a link."""

import pytest
from django.urls import reverse

from coordination.domain.states import MailboxMode
from coordination.plumbing.tracing import TraceContext
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"

pytestmark = pytest.mark.django_db


@pytest.fixture
def task(project):
    run = run_create(project_id=project.id, name="traced")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="work", mode=MailboxMode.WORK)
    task, _ = task_submit(
        project_id=project.id, mailbox=mailbox, run_id=run.id, input={}, trace=TraceContext(TRACEPARENT, "a=b")
    )
    return task


def page(client, task) -> str:
    response = client.get(reverse("admin:coordination_task_change", args=[task.pk]))
    assert response.status_code == 200
    return response.content.decode()


def test_the_task_page_shows_the_trace_id_as_text_without_a_trace_url(admin_client, task, settings):
    settings.RUNSTATE_TRACE_URL = ""
    html = page(admin_client, task)
    assert TRACE_ID in html
    assert f">{TRACE_ID}</a>" not in html


def test_the_trace_url_makes_the_trace_id_a_link(admin_client, task, settings):
    settings.RUNSTATE_TRACE_URL = "https://tempo.example/trace/{trace_id}?from=runstate"
    html = page(admin_client, task)
    assert f'href="https://tempo.example/trace/{TRACE_ID}?from=runstate"' in html
    assert f">{TRACE_ID}</a>" in html


def test_a_trace_url_that_is_not_http_stays_text(admin_client, task, settings):
    settings.RUNSTATE_TRACE_URL = "javascript:alert('{trace_id}')"
    html = page(admin_client, task)
    assert "javascript:" not in html
    assert TRACE_ID in html


def test_an_invalid_traceparent_header_stores_no_context():
    assert TraceContext.from_headers("00-zzzz-00f067aa0ba902b7-01") == TraceContext()
    assert TraceContext.from_headers(f"00-{'0' * 32}-00f067aa0ba902b7-01") == TraceContext()
    assert TraceContext.from_headers(f"ff-{TRACE_ID}-00f067aa0ba902b7-01") == TraceContext()
    assert TraceContext.from_headers(TRACEPARENT, "x" * 600) == TraceContext(TRACEPARENT, "")
    # A later version's extra fields are dropped; the version 00 part is kept.
    later = f"01-{TRACE_ID}-00f067aa0ba902b7-01-extra"
    assert TraceContext.from_headers(later).traceparent == later[:55]
