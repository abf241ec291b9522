"""The per-process caches of API keys and mailboxes (coordination/plumbing/process_cache.py).

A cached row costs a request no query; a change to the row, committed anywhere, is
forgotten by every process through NOTIFY; nothing read before a reconnect or during an
invalidation is served.
"""

import time

import httpx
import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from coordination.domain.states import MailboxMode
from coordination.models import ApiKey
from coordination.plumbing import process_cache
from coordination.services.keys import ALL_PERMISSIONS, api_key_authenticate, api_key_create, api_key_revoke
from coordination.services.mailboxes import mailbox_ensure, mailbox_get
from tests.operator.live import uvicorn_server
from tests.waiting import wait_until
from tests.workers import live


def caches_on(settings) -> None:
    """Turn the caches on in this process, as the API's ASGI app does, and wait for LISTEN."""
    settings.RUNSTATE_PROCESS_CACHE_S = 3600  # nothing expires during a test: only a notification forgets
    assert process_cache.enable()
    wait_until(lambda: process_cache._state.epoch is not None, what="the LISTEN connection")


def committed_elsewhere(sql: str, params: tuple = (), *, notify: bool = True) -> None:
    """Run ``sql`` on a connection of its own and commit; ``notify=False`` silences the triggers."""
    with psycopg.connect(live.test_database_url(), autocommit=True) as other:
        with other.transaction():
            if not notify:
                other.execute("SET LOCAL session_replication_role = replica")
            other.execute(sql, params)


def listeners() -> int:
    """Count the hubs' LISTEN connections to the test database (their last statement; they listen
    for cache changes first). Servers of another test run on the same cluster are not counted."""
    with psycopg.connect(live.test_database_url(), autocommit=True) as other:
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'LISTEN runstate'"
        return other.execute(query).fetchone()[0]


@pytest.fixture
def key(transactional_db, project):
    return api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="cached")


pytestmark = pytest.mark.postgres_only


def test_a_cached_key_costs_no_query(settings, key):
    caches_on(settings)
    assert api_key_authenticate(key.plaintext).id == key.api_key.id
    with CaptureQueriesContext(connection) as queries:
        again = api_key_authenticate(key.plaintext)
    assert again.id == key.api_key.id
    assert len(queries) == 0, [q["sql"] for q in queries]


def test_a_wrong_secret_is_refused_and_not_cached(settings, key):
    caches_on(settings)
    api_key_authenticate(key.plaintext)
    wrong = key.plaintext[:-4] + ("aaaa" if not key.plaintext.endswith("aaaa") else "bbbb")
    assert api_key_authenticate(wrong) is None
    assert len(process_cache.api_keys) == 1


def test_a_change_committed_by_another_connection_is_forgotten(settings, key):
    caches_on(settings)
    assert api_key_authenticate(key.plaintext) is not None
    committed_elsewhere("UPDATE coordination_apikey SET revoked_at = now() WHERE id = %s", (key.api_key.id,))
    wait_until(lambda: api_key_authenticate(key.plaintext) is None, what="the revoked key to be refused")


def test_the_cache_really_serves_until_notified(settings, key):
    """A change made with the triggers silenced is not seen: the answer came from the cache."""
    caches_on(settings)
    assert api_key_authenticate(key.plaintext) is not None
    silent = "UPDATE coordination_apikey SET revoked_at = now() WHERE id = %s"
    committed_elsewhere(silent, (key.api_key.id,), notify=False)
    assert api_key_authenticate(key.plaintext) is not None
    committed_elsewhere("SELECT pg_notify('runstate_cache', %s)", (str(key.api_key.id),))
    wait_until(lambda: api_key_authenticate(key.plaintext) is None, what="the notification")


def test_revoking_in_this_process_forgets_at_once(settings, key):
    caches_on(settings)
    assert api_key_authenticate(key.plaintext) is not None
    api_key_revoke(api_key_id=key.api_key.id)
    assert api_key_authenticate(key.plaintext) is None


def test_a_truncate_forgets_everything(settings, key, project):
    caches_on(settings)
    api_key_authenticate(key.plaintext)
    mailbox_ensure(project_id=project.id, name="m", mode=MailboxMode.WORK)
    mailbox_get(project_id=project.id, name="m")
    assert len(process_cache.api_keys) == 1 and len(process_cache.mailboxes) == 1
    committed_elsewhere("SELECT pg_notify('runstate_cache', '*')")
    wait_until(lambda: len(process_cache.api_keys) + len(process_cache.mailboxes) == 0, what="the caches to empty")


def test_a_mailbox_change_reaches_the_cache(settings, project, transactional_db):
    caches_on(settings)
    mailbox_ensure(project_id=project.id, name="m", mode=MailboxMode.WORK, lease_ttl_ms=1000)
    first = mailbox_get(project_id=project.id, name="m")
    assert first.lease_ttl_ms == 1000
    with CaptureQueriesContext(connection) as queries:
        hit = mailbox_get(project_id=project.id, name="m")
    assert hit == first and hit is not first  # the same row, in an object of the caller's own
    assert len(queries) == 0
    mailbox_ensure(project_id=project.id, name="m", mode=MailboxMode.WORK, lease_ttl_ms=2000)  # this process
    assert mailbox_get(project_id=project.id, name="m").lease_ttl_ms == 2000
    committed_elsewhere("UPDATE coordination_mailbox SET lease_ttl_ms = 3000 WHERE id = %s", (first.id,))
    wait_until(
        lambda: mailbox_get(project_id=project.id, name="m").lease_ttl_ms == 3000,
        what="the other connection's change",
    )


def test_nothing_read_before_a_reconnect_is_served(settings, key):
    caches_on(settings)
    api_key_authenticate(key.plaintext)
    assert process_cache.api_keys.get(key.api_key.key_hash) is not None
    epoch = process_cache._state.listening_epoch
    process_cache.on_listening(None)  # the LISTEN connection dropped: notifications may be lost
    assert process_cache.api_keys.get(key.api_key.key_hash) is None
    with CaptureQueriesContext(connection) as queries:
        assert api_key_authenticate(key.plaintext) is not None
    assert len(queries) == 1, "read from the database, and not kept, while LISTEN is down"
    assert len(process_cache.api_keys) == 0
    process_cache.on_listening(epoch + 1)
    api_key_authenticate(key.plaintext)
    assert len(process_cache.api_keys) == 1


def test_a_read_that_overlaps_an_invalidation_is_not_kept(settings, key):
    caches_on(settings)

    def read_while_the_row_changes():
        row = ApiKey.objects.get(id=key.api_key.id)
        process_cache.on_notification(str(key.api_key.id))  # arrives while the read is in flight
        return row

    answer = process_cache.api_keys.load("k", read_while_the_row_changes)
    assert answer.id == key.api_key.id
    assert process_cache.api_keys.get("k") is None


def test_off_by_setting(settings, key):
    settings.RUNSTATE_PROCESS_CACHE_S = 0
    assert not process_cache.enable()
    api_key_authenticate(key.plaintext)
    assert len(process_cache.api_keys) == 0


def test_a_revoked_key_is_refused_by_every_api_process(key, tmp_path):
    """Two API processes cache a key; a revoke committed by a third is refused by both, via NOTIFY.

    The servers keep entries for an hour, so only the notification can make them refuse the
    key; a silent change (triggers off) first shows that they do answer from their caches.
    """
    headers = {"Authorization": f"Bearer {key.plaintext}"}
    env = {"RUNSTATE_PROCESS_CACHE_S": "3600"}
    with uvicorn_server(tmp_path / "a", **env) as a, uvicorn_server(tmp_path / "b", **env) as b:
        servers = [a, b]

        def status(server) -> int:
            return httpx.get(f"{server.url}/v1/runs", headers=headers, timeout=10).status_code

        assert [status(s) for s in servers] == [200, 200]  # the first request starts each one's LISTEN
        wait_until(lambda: listeners() >= 2, what="both servers to listen")
        assert [status(s) for s in servers] == [200, 200]  # read after LISTEN: now cached
        silent = "UPDATE coordination_apikey SET revoked_at = now() WHERE id = %s"
        committed_elsewhere(silent, (key.api_key.id,), notify=False)
        assert [status(s) for s in servers] == [200, 200], "both servers answer from their caches"
        committed_elsewhere(
            "UPDATE coordination_apikey SET revoked_at = NULL WHERE id = %s", (key.api_key.id,), notify=False
        )

        revoked_at = time.monotonic()
        api_key_revoke(api_key_id=key.api_key.id)
        refused_after = {}
        for name, server in zip("ab", servers, strict=True):
            wait_until(lambda server=server: status(server) == 401, interval_s=0.02, what="the refusal")
            refused_after[name] = round(time.monotonic() - revoked_at, 3)
        print(f"\nrevoked key refused after (s): {refused_after}")
