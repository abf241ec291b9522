"""The decorated tasks this process knows (``registry``), and what the rest of ``workers`` may ask of one.

``workers.decorators`` fills the registry as modules declaring ``@runstate_task`` functions
are imported; the wake-ups (``workers.dispatch``) and the execution (``workers.runtime``)
find a mailbox's task here and know it only as a ``BoundTask``, so neither imports the
decorator that makes them.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Protocol

from django.core.exceptions import ImproperlyConfigured


class BoundTask(Protocol):
    """A function bound to a ``WORK`` mailbox (``workers.decorators.RunstateTask`` is the one kind)."""

    name: str
    project_name: str
    mailbox_name: str
    lease_ttl_ms: int | None
    is_async: bool
    fn: Any
    celery_task: Any

    @property
    def key(self) -> tuple[str, str]:
        """Return ``(project name, mailbox name)``."""

    def ids(self) -> tuple[uuid.UUID, uuid.UUID]:
        """Return ``(project id, mailbox id)``, ensured on first use in this process."""

    def validate_input(self, value: Any) -> None:
        """Raise ``ValidationFailed`` unless ``value`` is a valid input."""

    def kwargs_for(self, value: Any) -> dict[str, Any]:
        """Return the keyword arguments the function is called with for ``value``."""

    def retry_delay_ms(self, attempt: int) -> int:
        """Return how long a failed ``attempt`` waits before it is claimable again."""


class Registry:
    """The decorated tasks this process knows, by ``(project name, mailbox name)``.

    Lookups from the services start with the mailbox name alone (no query for a mailbox no
    decorated task uses); a mailbox id is then resolved to its names once and cached, which
    is safe because neither changes.
    """

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], BoundTask] = {}
        self._mailbox_names: set[str] = set()
        self._key_by_mailbox_id: dict[uuid.UUID, tuple[str, str]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def __iter__(self):
        return iter(list(self._by_key.values()))

    def register(self, task: BoundTask) -> None:
        """Bind ``task`` to its mailbox; another decorated task on the same mailbox is an error."""
        with self._lock:
            existing = self._by_key.get(task.key)
            if existing is not None and existing.name != task.name:
                raise ImproperlyConfigured(
                    f"Mailbox {task.mailbox_name!r} of project {task.project_name!r} is already bound to "
                    f"{existing.name!r}; one decorated task per mailbox."
                )
            self._by_key[task.key] = task
            self._mailbox_names.add(task.mailbox_name)

    def unregister(self, task: BoundTask) -> None:
        """Forget ``task`` (tests and examples that bind temporarily)."""
        with self._lock:
            if self._by_key.get(task.key) is task:
                del self._by_key[task.key]
                self._mailbox_names = {name for _, name in self._by_key}

    def for_mailbox(self, mailbox_id: uuid.UUID, name: str | None = None) -> BoundTask | None:
        """Return the decorated task bound to the mailbox ``mailbox_id`` (named ``name`` if known), or None."""
        if not self._by_key or (name is not None and name not in self._mailbox_names):
            return None
        key = self._key_by_mailbox_id.get(mailbox_id)
        if key is None:
            from coordination.models import Mailbox

            row = Mailbox.objects.filter(id=mailbox_id).values_list("project__name", "name").first()
            if row is None:
                return None
            key = self._key_by_mailbox_id[mailbox_id] = (row[0], row[1])
        return self._by_key.get(key)

    def mailbox_ids(self) -> list[uuid.UUID]:
        """Return the ids of the bound mailboxes that exist (one query)."""
        from django.db.models import Q

        from coordination.models import Mailbox

        keys = list(self._by_key)
        if not keys:
            return []
        match = Q()
        for project_name, mailbox_name in keys:
            match |= Q(project__name=project_name, name=mailbox_name)
        return list(Mailbox.objects.filter(match).values_list("id", flat=True))


registry = Registry()
