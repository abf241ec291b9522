"""Identifier generation: time-ordered UUIDs, so new rows land at the right edge of indexes."""

import secrets
import time
import uuid


def uuid7() -> uuid.UUID:
    """Return a UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then 74 random bits."""
    unix_ms = time.time_ns() // 1_000_000
    rand = secrets.randbits(74)
    value = (unix_ms & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= (rand >> 62) << 64  # rand_a, 12 bits
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b, 62 bits
    return uuid.UUID(int=value)


def fence_id(prefix: str, object_id: uuid.UUID, attempt: int) -> str:
    """Return the opaque id of ``attempt`` on ``object_id``: a claim (``c``) or a delivery (``d``)."""
    return f"{prefix}_{object_id.hex}_{attempt}"


def fence_id_sql(prefix: str, object_id_sql: str, attempt_sql: str) -> str:
    """Return ``fence_id`` as a PostgreSQL expression over a uuid and an integer expression (the same text)."""
    if not prefix.isalpha():
        raise ValueError(prefix)
    return f"'{prefix}_' || replace({object_id_sql}::text, '-', '') || '_' || {attempt_sql}"


def parse_fence_id(prefix: str, value: object) -> tuple[uuid.UUID, int]:
    """Split a ``fence_id`` into object id and attempt; raise ``ValueError`` when malformed."""
    found_prefix, object_hex, attempt = str(value).split("_")
    if found_prefix != prefix:
        raise ValueError(found_prefix)
    return uuid.UUID(hex=object_hex), int(attempt)


# A claim's id: ``c_<task>_<attempt>``, the fence of every operation of that attempt.
CLAIM_PREFIX = "c"


def claim_id_for(task_id: uuid.UUID, attempt: int) -> str:
    """Return the claim id of ``attempt`` on ``task_id``."""
    return fence_id(CLAIM_PREFIX, task_id, attempt)


def claim_id_sql(task_id_sql: str, attempt_sql: str) -> str:
    """Return ``claim_id_for`` as a PostgreSQL expression over a task id and an attempt expression."""
    return fence_id_sql(CLAIM_PREFIX, task_id_sql, attempt_sql)


def path_ids(path: str) -> list[uuid.UUID]:
    """Return the run ids of a run path (``/<root>/.../<run>/``), root first."""
    return [uuid.UUID(part) for part in path.split("/") if part]
