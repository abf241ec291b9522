"""What the process caches hand out is each caller's own (coordination/plumbing/process_cache.py).

An API process serves many requests at once from one cache: a key or mailbox that one
request's thread changes (an attribute set, a related row touched, a list field appended to)
must not change under another thread, nor in the entry the next request gets.

The caches are switched on here by hand (as if the LISTEN connection were up), so these
tests need neither PostgreSQL's NOTIFY nor a server, and run on both databases.
"""

import dataclasses
import threading

import pytest

from coordination.domain.states import MailboxMode
from coordination.models import ApiKey, Mailbox, Project, Run
from coordination.plumbing import process_cache
from coordination.services.keys import (
    ALL_PERMISSIONS,
    CachedKey,
    api_key_authenticate,
    api_key_create,
    api_key_revoke,
    cached_key,
)
from coordination.services.mailboxes import mailbox_ensure, mailbox_get


@pytest.fixture
def caches_serving(monkeypatch):
    """The caches serve, as under the API's ASGI app with its LISTEN connection up; nothing expires."""
    monkeypatch.setattr(process_cache._state, "enabled", True)
    monkeypatch.setattr(process_cache._state, "ttl_s", 3600.0)
    monkeypatch.setattr(process_cache._state, "listening_epoch", 1)
    process_cache.clear_all()
    yield
    process_cache.clear_all()


def a_key() -> ApiKey:
    """An API key as ``_matching_key`` reads it: with its project and run (select_related)."""
    project = Project(name="cached project")
    run = Run(project=project, name="bound run")
    return ApiKey(project=project, run=run, name="cached", prefix="ab12cd34", key_hash="0" * 64, permissions=["read"])


def in_threads(*steps):
    """Run each step in a thread of its own, one after the other, and return their results."""
    results = [None] * len(steps)

    def run(index):
        results[index] = steps[index]()

    for index in range(len(steps)):
        thread = threading.Thread(target=run, args=(index,))
        thread.start()
        thread.join()
    return results


def test_a_thread_changing_its_cached_key_changes_no_other_threads_key(caches_serving):
    key = a_key()
    cache = process_cache.api_keys
    loaded = threading.Event()
    changed = threading.Event()
    seen = {}

    def first():
        mine = cache.load("digest", lambda: key)
        loaded.set()
        changed.wait(10)
        seen["first"] = (mine.name, list(mine.permissions), mine.project.name, mine.run.name)

    def second():
        loaded.wait(10)
        mine = cache.load("digest", lambda: pytest.fail("a hit reads nothing"))
        mine.name = "changed"
        mine.permissions.append("admin")
        mine.project.name = "changed project"
        mine.run.name = "changed run"
        changed.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen["first"] == ("cached", ["read"], "cached project", "bound run")
    fresh = cache.load("digest", lambda: pytest.fail("a hit reads nothing"))
    assert (fresh.name, fresh.permissions, fresh.project.name, fresh.run.name) == (
        "cached",
        ["read"],
        "cached project",
        "bound run",
    )


def test_two_hits_are_two_objects_and_neither_is_the_one_read(caches_serving):
    key = a_key()
    cache = process_cache.api_keys
    read_one = cache.load("digest", lambda: key)
    assert read_one is key  # a miss hands out what it read
    key.revoked_at = "changed after it was cached"  # the reader's own: the entry is not
    hit_one, hit_two = in_threads(lambda: cache.get("digest"), lambda: cache.get("digest"))
    assert hit_one is not hit_two
    assert hit_one.revoked_at is None and hit_two.revoked_at is None
    assert hit_one.project is not hit_two.project
    assert hit_one.pk == key.pk and hit_one.project_id == key.project_id


def test_a_cached_mailbox_changed_by_one_thread_is_unchanged_for_the_next(caches_serving):
    cache = process_cache.mailboxes
    mailbox = Mailbox(project=Project(name="p"), name="jobs", mode=MailboxMode.QUEUE, lease_ttl_ms=30_000)
    cache.load(("p", "jobs"), lambda: mailbox)
    (changed,) = in_threads(lambda: cache.get(("p", "jobs")))
    changed.lease_ttl_ms = 1
    again = cache.get(("p", "jobs"))
    assert again.lease_ttl_ms == 30_000


@pytest.mark.django_db
def test_the_services_hand_out_a_key_and_mailbox_of_the_callers_own(caches_serving, project):
    issued = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="served")
    mailbox_ensure(project_id=project.id, name="jobs", mode=MailboxMode.QUEUE)
    api_key_authenticate(issued.plaintext)  # read here, in the test's transaction; the threads hit
    first_key, second_key = in_threads(*[lambda: api_key_authenticate(issued.plaintext, cached_only=True)] * 2)
    first_key.permissions.clear()
    first_key.project.name = "changed"
    assert sorted(second_key.permissions) == sorted(ALL_PERMISSIONS)
    assert sorted(api_key_authenticate(issued.plaintext, cached_only=True).permissions) == sorted(ALL_PERMISSIONS)
    assert api_key_authenticate(issued.plaintext, cached_only=True).project.name == project.name

    mailbox_get(project_id=project.id, name="jobs")
    (changed_box,) = in_threads(lambda: mailbox_get(project_id=project.id, name="jobs"))
    changed_box.lease_ttl_ms = 1
    assert mailbox_get(project_id=project.id, name="jobs").lease_ttl_ms != 1


def test_the_shared_key_is_one_immutable_object_and_every_copy_stays_each_callers_own(caches_serving):
    """``get_shared`` (the hot path's key) hands every thread one value nobody can change; ``get`` still copies."""
    key = a_key()
    key.run = None
    cache = process_cache.api_keys
    cache.load("digest", lambda: key)
    first, second = in_threads(*[lambda: cache.get_shared("digest", CachedKey.of)] * 2)
    assert first is second
    assert first == CachedKey.of(key) and first.permissions == frozenset({"read"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.revoked_at = "changed"
    with pytest.raises(AttributeError):
        first.permissions.add("admin")
    copy = cache.get("digest")
    copy.permissions.append("admin")
    assert cache.get_shared("digest", CachedKey.of).permissions == frozenset({"read"})
    assert cache.get("digest").permissions == ["read"]
    cache.forget_row(key.pk)  # the row changed: the shared value goes with its entry
    assert cache.get_shared("digest", CachedKey.of) is None


@pytest.mark.django_db
def test_the_cached_key_is_what_api_key_authenticate_answers(caches_serving, project):
    issued = api_key_create(project_id=project.id, permissions=["coordination_read"], name="served")
    assert cached_key(issued.plaintext) is None  # not read yet: the cache alone answers nothing
    api_key_authenticate(issued.plaintext)
    shared, copy = cached_key(issued.plaintext), api_key_authenticate(issued.plaintext, cached_only=True)
    assert shared is cached_key(issued.plaintext)
    assert (shared.id, shared.project_id, shared.run_id, shared.last_used_at, shared.expires_at) == (
        copy.id,
        copy.project_id,
        copy.run_id,
        copy.last_used_at,
        copy.expires_at,
    )
    for permission in ALL_PERMISSIONS:
        assert shared.has_permission(permission) == copy.has_permission(permission)
    assert cached_key(issued.plaintext[:-1] + "x") is None and cached_key("rs_short_x") is None
    api_key_revoke(api_key_id=issued.api_key.id)  # forgets the entry in this process (post_save)
    assert cached_key(issued.plaintext) is None
