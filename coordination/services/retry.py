"""Retry signals shared by the task and group services, and the decorator that honours them.

Neutral ground between ``tasks``/``claims`` and ``groups``: both raise these signals and
both decorate their transactions with ``retrying``, so neither has to import the other at
module level for it.
"""

import functools
import logging
import random
import time
import uuid
from collections.abc import Callable

from django.db import OperationalError, connection

logger = logging.getLogger(__name__)

# PostgreSQL's SQLSTATE for "deadlock detected": it aborted this transaction to break a cycle.
DEADLOCK_DETECTED = "40P01"


class GroupMembershipChanged(Exception):  # noqa: N818 - internal retry signal, not an error
    """A task joined a group between our unlocked read and our lock: start the transaction over."""


class GroupDue(Exception):  # noqa: N818 - internal retry signal, not an error
    """The group is past its deadline (or its gate is inactive): finalize it first, in its own commit.

    The signal carries the groups service that finalizes (``group_finalize_if_due``), so
    this module imports no service and the groups service can import it.
    """

    def __init__(self, group_id: uuid.UUID, *, finalize: Callable[..., object]) -> None:
        super().__init__(str(group_id))
        self.group_id = group_id
        self.finalize = finalize


def deadlocked(error: BaseException) -> bool:
    """Tell whether ``error`` is PostgreSQL aborting the transaction to break a deadlock."""
    return getattr(error.__cause__, "sqlstate", None) == DEADLOCK_DETECTED


def retrying(fn):
    """Run a transactional service again after a retry signal (a few times at most).

    ``GroupDue`` first commits the group's finalization, so the retried operation sees the
    decided group (and refuses or records late, as the rules say) while the decision stays.
    A deadlock PostgreSQL broke by aborting this transaction is retried too, after a short
    random pause, when the service runs its own transaction (not inside a caller's, which the
    abort has spoilt: the outermost retrying service retries it). The house lock order rules
    out most cycles; this covers those it cannot, such as a cascade's locks on the gates of
    groups all over the tree (docs/internals.md, "One lock order"). Nothing of an aborted attempt
    stays: its writes and ``on_commit`` callbacks are rolled back with it.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outermost = not connection.in_atomic_block
        for attempt in range(5):
            try:
                return fn(*args, **kwargs)
            except GroupMembershipChanged:
                if attempt == 4:
                    raise
            except GroupDue as due:
                if attempt == 4:
                    raise
                due.finalize(group_id=due.group_id)
            except OperationalError as error:
                if attempt == 4 or not (outermost and deadlocked(error)):
                    raise
                logger.info("%s was chosen to break a deadlock; retrying (attempt %d)", fn.__qualname__, attempt + 2)
                time.sleep(random.uniform(0, 0.01 * 2**attempt))  # noqa: S311 - jitter, not secrecy
        raise AssertionError("unreachable")

    return wrapper
