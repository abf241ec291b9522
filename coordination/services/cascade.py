"""The end of a run's subtree: what a cancel or complete does below the run, in one place.

``run_cancel`` and ``run_complete`` call ``subtree_end`` inside their own transaction after
locking the run ``FOR UPDATE``. Each feature registers its step with ``@cascade_step`` and
``CASCADE_ORDER`` gives it its place in the house lock order (groups before tasks before
barriers and timers), so the whole effect stays one transaction as features arrive.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from django.db import connection, models

from coordination.domain.states import RunState
from coordination.models import Run
from coordination.services.events import event_insert_sql
from coordination.services.sql import in_list


@dataclass(frozen=True)
class SubtreeEnd:
    """A run whose subtree stops accepting work, and why."""

    run: Run
    state: RunState | None  # CANCELLED or COMPLETED; None when the run's deadline passed
    reason: str | None
    now: datetime
    # Scratch space for steps that work in two halves around another step (groups).
    memo: dict = field(default_factory=dict)

    @property
    def cause(self) -> str:
        """Return why the subtree ends, as recorded in its events."""
        if self.state is None:
            return "run_deadline"
        return "run_cancelled" if self.state == RunState.CANCELLED else "run_completed"

    @property
    def by_deadline(self) -> bool:
        """Tell whether the subtree ends because a deadline passed (unfinished tasks then expire)."""
        return self.state is None

    @property
    def path_prefix(self) -> str:
        """Return the path prefix shared by the run and every run below it."""
        return self.run.path


CascadeStep = Callable[[SubtreeEnd], None]

# The steps, by name, in house lock order: groups, then tasks, then barriers and timers. Each
# step lives with its aggregate and registers itself there (``@cascade_step``), so this
# module imports no aggregate and every aggregate may import it; the order stays here, in
# one place, because the steps lock rows and only one order avoids deadlocks.
CASCADE_ORDER: tuple[str, ...] = (
    "groups_end_subtree",  # finalize groups gated in the subtree; lock groups of members in it
    "tasks_cancel_subtree",
    "groups_reevaluate_after_subtree_end",  # members elsewhere' groups may now be decided
    "messages_cancel_subtree",
    "barriers_cancel_subtree",
    "timers_cancel_subtree",
    "pools_cancel_subtree",  # answer the subtree's pool waiters; held leases stay held
    "admissions_end_subtree",  # after the work: frees the run's slot, may create a sibling run
)

_registered: dict[str, CascadeStep] = {}


def cascade_step(step: CascadeStep) -> CascadeStep:
    """Register ``step`` (a function named in ``CASCADE_ORDER``) as a step of every subtree end; return it.

    A decorator for the aggregates' step functions. A name missing from ``CASCADE_ORDER``
    raises: a new step must be given its place in the lock order, not run in import order.
    """
    name = step.__name__
    if name not in CASCADE_ORDER:
        raise ValueError(f"{name} is not a cascade step: give it its place in CASCADE_ORDER (cascade.py)")
    registered = _registered.get(name)
    if registered is not None and registered.__module__ != step.__module__:
        raise ValueError(f"{name} is registered by {registered.__module__} already")
    _registered[name] = step
    return step


def cascade_steps() -> tuple[CascadeStep, ...]:
    """Return the registered steps in ``CASCADE_ORDER``; raise when one has not registered.

    The aggregates register as they are imported: ``CoordinationConfig.ready`` imports them
    all, so a missing step is a start-up error, never a cascade that silently skips a table.
    """
    missing = [name for name in CASCADE_ORDER if name not in _registered]
    if missing:
        raise RuntimeError(f"cascade steps not registered (their modules not imported): {', '.join(missing)}")
    return tuple(_registered[name] for name in CASCADE_ORDER)


def subtree_end(end: SubtreeEnd) -> None:
    """Apply every step to the subtree of ``end.run``, inside the caller's transaction."""
    for step in cascade_steps():
        step(end)


# The data of the event of a task, message or timer the cascade ended: {"reason": ..., "cause": ...}.
END_EVENT_DATA_SQL = "jsonb_build_object('reason', %(reason)s::text, 'cause', %(cause)s::text)"


def subtree_rows_end(
    end: SubtreeEnd,
    model: type[models.Model],
    *,
    states: Iterable[str],
    final_state: str,
    event_type: str,
    also_set: str = "",
    data_sql: str = END_EVENT_DATA_SQL,
    returning: str = "",
    locked_columns: str = "",
) -> int:
    """Move the subtree's rows of ``model`` from ``states`` to ``final_state``, one event each: one statement.

    PostgreSQL only. The rows (``run_path`` under the run, ``state`` in ``states``) are locked
    in id order (the lock order among rows of one table), updated and their events inserted
    by the same data-modifying CTE, so the cost in round trips does not grow with the
    subtree. ``also_set`` (more assignments) and ``data_sql`` may use the parameters ``now``,
    ``reason`` and ``cause``; ``data_sql`` sees the updated rows (``id``, ``project_id``,
    ``run_id``, ``run_path`` and the column named in ``returning``) and, with
    ``locked_columns``, those columns of each row as it was before the update, as ``was``
    (``was.state``). Every event is dated ``end.now``. Return how many rows ended.
    """
    table = model._meta.db_table
    states = list(states)
    # The states are written into the SQL as literals (``sql.literal`` checks they are state
    # names), so that even a generic plan of the prepared statement matches a partial index on
    # them, e.g. ``task_unfinished_run_path`` (text_pattern_ops).
    state_sql = in_list(states)
    # ARRAY(...) runs the locking subquery once, before the update, and the update then finds
    # the rows by primary key: as a join, the planner may hash the ids and scan the whole table.
    assignments = ", ".join(filter(None, ["state = %(final_state)s", also_set]))
    extra = f", t.{returning}" if returning else ""
    locking = f"SELECT id{', ' + locked_columns if locked_columns else ''} FROM {table} " + (
        f"WHERE run_path LIKE %(prefix)s AND state IN {state_sql} ORDER BY id FOR UPDATE"
    )
    # The rows as they were are kept by a materialized CTE, read once; the update still finds
    # its rows by primary key through ARRAY(...).
    was = f"was AS MATERIALIZED ({locking}), " if locked_columns else ""
    ids = "SELECT id FROM was" if locked_columns else locking
    sql = (
        f"WITH {was}ended AS (UPDATE {table} AS t SET {assignments} WHERE t.id = ANY(ARRAY({ids})) "
        f"RETURNING t.id, t.project_id, t.run_id, t.run_path{extra}) "
        + event_insert_sql(
            "ended JOIN was USING (id)" if locked_columns else "ended", type_sql="%(event_type)s", data_sql=data_sql
        )
    )
    values = {
        "prefix": connection.ops.prep_for_like_query(end.path_prefix) + "%",
        "now": end.now,
        "reason": end.reason,
        "cause": end.cause,
        "event_type": event_type,
        "final_state": final_state,
    }
    with connection.cursor() as cursor:
        cursor.execute(sql, values)
        return cursor.rowcount
