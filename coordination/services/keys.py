"""Projects and API keys: create, authenticate, revoke."""

import hashlib
import hmac
import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from coordination.domain import exceptions
from coordination.domain.states import Permission
from coordination.models import ApiKey, Project, Run
from coordination.plumbing import process_cache

KEY_PREFIX_LENGTH = 12
PROJECT_NAME_PATTERN = re.compile(r"^[-a-zA-Z0-9_]{1,100}$")
ALL_PERMISSIONS = tuple(str(p) for p in Permission)


def hash_key(plaintext: str) -> str:
    """Return the SHA-256 hex digest of a key (keys are random, so no slow hash is needed)."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedKey:
    """A newly created key: the row, and the plaintext shown exactly once."""

    api_key: ApiKey
    plaintext: str


@transaction.atomic
def project_ensure(*, name: str) -> Project:
    """Return the project called ``name`` (a slug), creating it if needed."""
    if not PROJECT_NAME_PATTERN.fullmatch(name or ""):
        raise exceptions.ValidationFailed("Invalid project name.", name="1-100 of a-z A-Z 0-9 _ -")
    project, _ = Project.objects.get_or_create(name=name)
    return project


def _validate_permissions(permissions: list[str]) -> list[str]:
    unknown = sorted(set(permissions) - set(ALL_PERMISSIONS))
    if unknown or not permissions:
        raise exceptions.ValidationFailed(
            "Unknown or missing permissions.",
            permissions=f"choose from {', '.join(ALL_PERMISSIONS)}; got {', '.join(unknown) or 'none'}",
        )
    return sorted(set(permissions))


@transaction.atomic
def api_key_create(
    *,
    project_id: uuid.UUID,
    permissions: list[str],
    name: str = "",
    run_id: uuid.UUID | None = None,
    expires_at: datetime | None = None,
) -> IssuedKey:
    """Create a key and return it with its plaintext, which is stored nowhere."""
    permissions = _validate_permissions(permissions)
    if run_id is not None and not Run.objects.filter(id=run_id, project_id=project_id).exists():
        raise exceptions.NotFound("Run not found.", runId=str(run_id))
    prefix = secrets.token_hex(KEY_PREFIX_LENGTH // 2)
    plaintext = f"rs_{prefix}_{secrets.token_urlsafe(32)}"
    api_key = ApiKey.objects.create(
        project_id=project_id,
        name=name,
        prefix=prefix,
        key_hash=hash_key(plaintext),
        permissions=permissions,
        run_id=run_id,
        expires_at=expires_at,
    )
    return IssuedKey(api_key=api_key, plaintext=plaintext)


def _key_parts(plaintext: str) -> list[str] | None:
    """Return ``["rs", prefix, secret]`` when ``plaintext`` has a key's shape, else None."""
    parts = plaintext.split("_", 2)
    if len(parts) != 3 or parts[0] != "rs" or len(parts[1]) != KEY_PREFIX_LENGTH:
        return None
    return parts


def api_key_authenticate(plaintext: str, *, cached_only: bool = False) -> ApiKey | None:
    """Return the usable key matching ``plaintext``, or None (unknown, revoked, expired).

    ``cached_only`` answers from this process's cache alone, without the database (None
    when the key is not cached): the event loop may call it.
    """
    parts = _key_parts(plaintext)
    if parts is None:
        return None
    digest = hash_key(plaintext)
    # Cached by the whole key's digest: a hit is a key whose secret matched when it was read.
    if cached_only:
        api_key = process_cache.api_keys.get(digest)
    else:
        api_key = process_cache.api_keys.load(digest, lambda: _matching_key(parts[1], digest))
    if api_key is None:
        return None
    if not api_key.is_usable(timezone.now()):
        return None
    return api_key


@dataclass(frozen=True)
class CachedKey:
    """What the event loop reads of a cached key (``cached_key``): immutable, so one object serves every request.

    ``has_permission`` and ``is_usable`` are the model's own, over the same fields.
    """

    id: uuid.UUID
    project_id: uuid.UUID
    run_id: uuid.UUID | None
    permissions: frozenset[str]
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None

    has_permission = ApiKey.has_permission
    is_usable = ApiKey.is_usable

    @classmethod
    def of(cls, api_key: ApiKey) -> "CachedKey":
        """Return the fields of ``api_key`` the hot path reads."""
        return cls(
            id=api_key.id,
            project_id=api_key.project_id,
            run_id=api_key.run_id,
            permissions=frozenset(api_key.permissions),
            last_used_at=api_key.last_used_at,
            revoked_at=api_key.revoked_at,
            expires_at=api_key.expires_at,
        )


def cached_key(plaintext: str) -> CachedKey | None:
    """Return ``api_key_authenticate(plaintext, cached_only=True)`` as a ``CachedKey`` every caller shares.

    No copy of the cached row per call (``api_key_authenticate`` unpickles one): the event
    loop's hot path reads a key on every request and changes nothing of it.
    """
    if _key_parts(plaintext) is None:
        return None
    api_key = process_cache.api_keys.get_shared(hash_key(plaintext), CachedKey.of)
    if api_key is None or not api_key.is_usable(timezone.now()):
        return None
    return api_key


def _matching_key(prefix: str, digest: str) -> ApiKey | None:
    """Return the key with ``prefix`` if its hash is ``digest``, else None."""
    api_key = ApiKey.objects.select_related("project", "run").filter(prefix=prefix).first()
    # Compare even when there is no such key, so an unknown prefix costs what a wrong secret does.
    matches = hmac.compare_digest(digest, api_key.key_hash if api_key is not None else "0" * 64)
    return api_key if matches and api_key is not None else None


@transaction.atomic
def api_key_revoke(*, api_key_id: uuid.UUID) -> ApiKey:
    """Revoke a key; idempotent."""
    api_key = ApiKey.objects.select_for_update().get(id=api_key_id)
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key
