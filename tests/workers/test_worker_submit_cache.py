"""A submit in a Celery worker reads its mailbox from the process cache, and hears of a change at once."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from coordination.plumbing import process_cache
from coordination.services.runs import run_create
from tests.api.test_process_cache import committed_elsewhere
from tests.waiting import wait_until
from workers import decorators, runstate_task
from workers.registry import registry

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def follow_up():
    @runstate_task(mailbox="cached-follow-up", project="worker-cache", max_attempts=3)
    def follow_up(ctx):
        return None

    yield follow_up
    registry.unregister(follow_up)


def test_a_worker_submit_reads_its_mailbox_from_the_process_cache_until_the_row_changes(
    settings, monkeypatch, follow_up
):
    settings.RUNSTATE_PROCESS_CACHE_S = 3600  # nothing expires during the test: only a notification forgets
    # What workers.apps does when a Celery worker starts.
    monkeypatch.setitem(decorators._process_cache, "asked", False)
    monkeypatch.setitem(decorators._process_cache, "started_in", None)
    decorators.cache_mailboxes_in_this_worker(sender=None)
    run = run_create(project_id=follow_up.project_id)
    assert follow_up.submit(run.id).max_attempts == 3
    wait_until(lambda: process_cache._state.epoch is not None, what="the LISTEN connection")
    follow_up.submit(run.id)  # read once more since the listener is up: now cached
    with CaptureQueriesContext(connection) as queries:
        assert follow_up.submit(run.id).max_attempts == 3
    assert not [q for q in queries.captured_queries if "coordination_mailbox" in q["sql"].split("WHERE")[0]]

    _, mailbox_id = follow_up.ids()
    committed_elsewhere("UPDATE coordination_mailbox SET max_attempts = 7 WHERE id = %s", (mailbox_id,))
    wait_until(lambda: len(process_cache.mailboxes) == 0, what="the change's notification")
    assert follow_up.submit(run.id).max_attempts == 7
