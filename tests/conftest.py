"""Shared fixtures: projects, keys and API clients against the real database."""

import pytest
from django.db import connection
from django.test import TransactionTestCase
from rest_framework.test import APIClient

from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure
from tests.flush import flush_retrying_deadlocks, flush_written_tables, written_tables_first
from tests.passwords import hash_quickly


def pytest_configure(config):
    """Flush only what a transactional test wrote (tests/flush.py); hash passwords quickly (tests/passwords.py)."""
    from django.conf import settings

    hash_quickly(settings)
    teardown = written_tables_first(TransactionTestCase._fixture_teardown)
    TransactionTestCase._fixture_teardown = flush_retrying_deadlocks(teardown)


@pytest.fixture(scope="session", autouse=True)
def _flush_remembers_the_migrated_database(django_db_setup, django_db_blocker):
    """Record the content types and permissions ``flush_written_tables`` keeps (``tests/flush.py``)."""
    with django_db_blocker.unblock():
        flush_written_tables.remember("default")


def pytest_collection_modifyitems(config, items):
    """Deselect PostgreSQL-only tests when the suite runs on SQLite (they are not skips)."""
    from django.conf import settings

    if settings.DATABASES["default"]["ENGINE"].endswith("postgresql"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("postgres_only") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def is_postgres():
    return connection.vendor == "postgresql"


@pytest.fixture
def project(db):
    return project_ensure(name="acme")


@pytest.fixture
def other_project(db):
    return project_ensure(name="globex")


def secret_of(plaintext: str) -> str:
    """The secret part of a plaintext key ``rs_<prefix>_<secret>`` (the secret may itself hold ``_``)."""
    return plaintext.split("_", 2)[2]


def err(response, status_code, code):
    """Assert an error answer's status and code; return its ``error`` object."""
    assert response.status_code == status_code, response.content
    assert response.json()["error"]["code"] == code, response.json()
    return response.json()["error"]


def project_settings(project_id):
    """The project-wide settings a bound key could reach, and how many runs and groups there are."""
    from coordination.models import Mailbox, Pool, Quota, Run, TaskGroup

    return {
        "mailboxes": sorted(
            Mailbox.objects.filter(project_id=project_id).values_list("name", "mode", "lease_ttl_ms", "max_attempts")
        ),
        "pools": sorted(Pool.objects.filter(project_id=project_id).values_list("name", "capacity")),
        "quotas": sorted(Quota.objects.filter(project_id=project_id).values_list("name", "limit", "period_ms")),
        "runs": Run.objects.filter(project_id=project_id).count(),
        "groups": TaskGroup.objects.filter(project_id=project_id).count(),
    }


def make_client(project, permissions=ALL_PERMISSIONS, **kwargs):
    """Return an APIClient authenticated with a fresh key of ``project``."""
    issued = api_key_create(project_id=project.id, permissions=list(permissions), **kwargs)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}")
    client.issued = issued
    return client


@pytest.fixture
def api(project):
    """A client with every permission on ``project``."""
    return make_client(project)


@pytest.fixture
def other_api(other_project):
    """A client with every permission on another project."""
    return make_client(other_project)


@pytest.fixture
def anon():
    return APIClient()


@pytest.fixture(autouse=True)
def _process_caches_off():
    """Leave the process caches off after a test that served a request through the ASGI app.

    The app turns them on (as in every API process); the other tests read keys and mailboxes
    straight from the database, inside their own transactions.
    """
    yield
    from coordination.plumbing import process_cache

    process_cache.disable()


@pytest.fixture(scope="session", autouse=True)
def _stop_listener_before_dropping_the_database(django_db_setup, django_db_blocker):
    """Close every other session on the test database so that it can be dropped.

    The NOTIFY listener and any event feed left reading are stopped. Threads of the executors
    that ran ORM calls for the event loops (asgiref's, the hot path's careful path, the shared
    reads) keep a Django connection each until they exit, which is at interpreter exit, after
    pytest-django's ``DROP DATABASE``: the drop failed ("being accessed by other users") and
    left the database behind. Their sessions are ended here, on PostgreSQL.
    """
    yield
    from coordination.api import sse
    from coordination.plumbing.notify import hub
    from workers.runtime import renewer

    hub.stop()
    renewer().watcher.stop()  # a Celery handler run in this process started its claim watch
    # An in-process event stream whose client let go without a disconnect (httpx's ASGI
    # transport sends none) leaves its loop's shared feed reading: it would retry, and log
    # every failure, until interpreter exit, long after the database is gone.
    for loop, feed in sse.feeds():
        if not loop.is_closed():
            loop.call_soon_threadsafe(feed.task.cancel)
    if connection.vendor == "postgresql":
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
