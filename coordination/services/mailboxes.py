"""Mailboxes: ensure idempotently."""

import re
import uuid

from django.db import transaction

from coordination.domain import exceptions
from coordination.domain.states import MailboxMode
from coordination.models import Mailbox
from coordination.plumbing import process_cache

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
LEASE_TTL_RANGE_MS = (100, 24 * 3600 * 1000)
MAX_ATTEMPTS_RANGE = (1, 1000)


def validate_lease_ttl_ms(value: int | None, field: str = "leaseTtlMs") -> None:
    """Refuse a lease TTL outside 100 ms to 24 h."""
    low, high = LEASE_TTL_RANGE_MS
    if value is not None and not low <= value <= high:
        raise exceptions.ValidationFailed("Invalid lease TTL.", **{field: f"must be between {low} and {high}"})


def validate_max_attempts(value: int | None) -> None:
    """Refuse a maxAttempts outside 1 to 1000."""
    low, high = MAX_ATTEMPTS_RANGE
    if value is not None and not low <= value <= high:
        raise exceptions.ValidationFailed("Invalid maxAttempts.", maxAttempts=f"must be between {low} and {high}")


@transaction.atomic
def mailbox_ensure(
    *,
    project_id: uuid.UUID,
    name: str,
    mode: MailboxMode | str,
    lease_ttl_ms: int | None = None,
    max_attempts: int | None = None,
) -> tuple[Mailbox, bool]:
    """Return the mailbox ``name`` and whether this call created it.

    An existing mailbox keeps its mode (another mode is ``MAILBOX_MODE_CONFLICT``); settings
    given explicitly are updated.
    """
    if not NAME_PATTERN.fullmatch(name or ""):
        raise exceptions.ValidationFailed("Invalid mailbox name.", name="1-100 of A-Z a-z 0-9 . _ -")
    if mode not in MailboxMode.values:
        raise exceptions.ValidationFailed("Invalid mode.", mode="WORK or QUEUE")
    validate_lease_ttl_ms(lease_ttl_ms)
    validate_max_attempts(max_attempts)
    defaults = {"mode": mode}
    if lease_ttl_ms is not None:
        defaults["lease_ttl_ms"] = lease_ttl_ms
    if max_attempts is not None:
        defaults["max_attempts"] = max_attempts
    # get_or_create re-reads after a unique violation, so concurrent ensures all succeed.
    mailbox, created = Mailbox.objects.get_or_create(project_id=project_id, name=name, defaults=defaults)
    if created:
        return mailbox, True
    if mailbox.mode != mode:
        raise exceptions.MailboxModeConflict(name=name, mode=mailbox.mode)
    changed = [field for field, value in defaults.items() if getattr(mailbox, field) != value]
    if changed:
        for field in changed:
            setattr(mailbox, field, defaults[field])
        mailbox.save(update_fields=changed)
    return mailbox, False


def mailbox_cached(*, project_id: uuid.UUID, name: str) -> Mailbox | None:
    """Return the project's mailbox ``name`` from this process's cache alone, or None (the event loop may call it)."""
    return process_cache.mailboxes.get((project_id, name))


def mailbox_get(*, project_id: uuid.UUID, name: str, mode: MailboxMode | None = None) -> Mailbox:
    """Return the project's mailbox ``name``; ``mode`` given, refuse another mode."""
    # No mailbox has a name ensure refuses; asking the database could fail on it (a NUL).
    mailbox = (
        process_cache.mailboxes.load(
            (project_id, name),
            lambda: Mailbox.objects.filter(project_id=project_id, name=name).first(),
        )
        if NAME_PATTERN.fullmatch(name)
        else None
    )
    if mailbox is None:
        raise exceptions.NotFound("Mailbox not found.", mailbox=name)
    if mode is not None and mailbox.mode != mode:
        raise exceptions.MailboxModeConflict(
            f"Mailbox '{name}' is a {mailbox.mode} mailbox.", name=name, mode=mailbox.mode
        )
    return mailbox
