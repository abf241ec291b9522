"""Retry signals shared by the task and group services, and the decorator that honours them.

Neutral ground between ``tasks``/``claims`` and ``groups``: both raise these signals and
both decorate their transactions with ``retrying``, so neither has to import the other at
module level for it.
"""

import functools
import uuid
from collections.abc import Callable


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


def retrying(fn):
    """Run a transactional service again after a retry signal (a few times at most).

    ``GroupDue`` first commits the group's finalization, so the retried operation sees the
    decided group (and refuses or records late, as the rules say) while the decision stays.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
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
        raise AssertionError("unreachable")

    return wrapper
