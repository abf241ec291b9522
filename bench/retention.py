"""Retention on the partitioned event log: a day's events pruned by dropping its partition, against ``DELETE``.

Issue 30. In the same run, on the benchmark database (PostgreSQL, migrated: the event table is
partitioned by day, ``coordination/services/event_partitions.py``):

1. two past days get their partitions and ``--events`` events each (5,000,000), written by
   ``INSERT ... SELECT generate_series`` through the parent table, so every index the log has
   is built as the API would build it;
2. **drop**: retention's own step, ``event_partition_drop_expired`` with a cutoff at the end
   of the first day, drops that day's partition (timed from the call to its commit);
3. **delete**: one ``DELETE`` of the second day's events, the cheapest form of the row-by-row
   retention the log had before (timed from the statement to its commit); then the
   ``VACUUM`` of that day's table that reclaims its dead rows (timed apart: autovacuum would
   do it in the background, but the work is the deletion's).

A ``CHECKPOINT`` precedes each timed step, so neither pays for the other's writes. Target:
the drop takes under 1 s. ``--json PATH`` writes ``retention_drop_s``,
``retention_delete_s``, ``retention_vacuum_s``, ``events_per_day``, ``partition_mb`` and
``bytes_per_event`` (the day's table with its indexes over its rows); ``--record`` appends a
section to ``docs/benchmarks.md``.

Run: ``.venv/bin/python -m bench.retention [--events N]`` (PostgreSQL at ``DATABASE_URL``,
default the ``runstate_bench`` database).
"""

import argparse
import sys
import time
from datetime import UTC, date, datetime, timedelta

from bench.harness.env import RECORD_PATH, git_revision, setup_django
from bench.harness.report import write_json

# Far enough back that no other event of the benchmark database falls on these days.
DAYS_BACK = 400
TARGET_DROP_S = 1.0


def fill_day(day: date, events: int, project_id) -> None:
    """Write ``events`` events spread over ``day`` (UTC), in one statement."""
    from django.db import connection, transaction

    from coordination.services.event_partitions import PARENT

    start = datetime.combine(day, datetime.min.time(), tzinfo=UTC)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {PARENT} (txid, project_id, type, run_id, run_path, subject_id, data, created_at) "
            "SELECT n, %(project)s, 'task.succeeded', NULL, '', 't' || n, '{}'::jsonb, "
            "%(start)s + (n %% 86400000) * interval '1 millisecond' "
            "FROM generate_series(1, %(events)s) AS n",
            {"project": project_id, "start": start, "events": events},
        )


def checkpoint() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")


def timed_drop(first: date) -> float:
    """Drop ``first``'s partition through retention's own step; return the seconds it took."""
    from coordination.services.event_partitions import event_partition_days, event_partition_drop_expired

    end_of_first = datetime.combine(first + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    started = time.perf_counter()
    dropped = event_partition_drop_expired(cutoff=end_of_first)
    took = time.perf_counter() - started
    if dropped != 1 or first in event_partition_days():
        raise RuntimeError(f"the partition of {first} was not dropped")
    return took


def timed_delete(second: date, events: int) -> float:
    """Delete ``second``'s events with one ``DELETE``; return the seconds it took."""
    from django.db import connection, transaction

    from coordination.services.event_partitions import PARENT

    start = datetime.combine(second, datetime.min.time(), tzinfo=UTC)
    started = time.perf_counter()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {PARENT} WHERE created_at >= %s AND created_at < %s", [start, start + timedelta(days=1)]
        )
        deleted = cursor.rowcount
    took = time.perf_counter() - started
    if deleted != events:
        raise RuntimeError(f"DELETE removed {deleted} events, not {events}")
    return took


def timed_vacuum(second: date) -> float:
    """``VACUUM`` ``second``'s partition (its rows deleted); return the seconds it took."""
    from django.db import connection

    from coordination.services.event_partitions import partition_name

    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM {partition_name(second)}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=5_000_000, help="events per day (5,000,000)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args(argv)

    setup_django()
    from django.db import connection

    from coordination.services.event_partitions import (
        event_partition_days,
        event_partition_drop_expired,
        event_partitions_create_ahead,
        is_partitioned,
        partition_name,
    )
    from coordination.services.keys import project_ensure

    if not is_partitioned():
        raise SystemExit("the event table is not partitioned: run this on PostgreSQL, migrated")
    today = datetime.now(UTC).date()
    first, second = today - timedelta(days=DAYS_BACK), today - timedelta(days=DAYS_BACK - 1)
    # Nothing older than the first day may be dropped in its place; leftovers of an earlier run go.
    while event_partition_drop_expired(cutoff=datetime.combine(first, datetime.min.time(), tzinfo=UTC)):
        pass
    for day in (first, second):
        if day in event_partition_days():
            with connection.cursor() as cursor:
                cursor.execute(f"DROP TABLE {partition_name(day)}")
    event_partitions_create_ahead(days=1, today=first)
    project = project_ensure(name="bench-retention")

    for day in (first, second):
        print(f"writing {args.events:,} events on {day} ...", flush=True)
        began = time.perf_counter()
        fill_day(day, args.events, project.id)
        print(f"  written in {time.perf_counter() - began:.1f} s", flush=True)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT pg_total_relation_size('{partition_name(first)}')")
        size_mb = cursor.fetchone()[0] / 2**20

    checkpoint()
    drop_s = timed_drop(first)
    checkpoint()
    delete_s = timed_delete(second, args.events)
    vacuum_s = timed_vacuum(second)
    with connection.cursor() as cursor:  # the emptied day goes too (untimed)
        cursor.execute(f"DROP TABLE {partition_name(second)}")

    figures = json_figures(drop_s, delete_s, vacuum_s, args.events, size_mb)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    verdict = "met" if drop_s < TARGET_DROP_S else "NOT met"
    lines = [
        f"### Retention: a day's partition dropped against `DELETE` (`bench/retention.py`), {when}, {git_revision()}",
        "",
        f"A day of {args.events:,} events ({size_mb:,.0f} MB with its indexes, "
        f"{size_mb * 2**20 / args.events:,.0f} bytes an event), as many on the next day, same run.",
        "",
        "| prune of one day | seconds |",
        "| --- | ---: |",
        f"| drop its partition (`event_partition_drop_expired`) | {drop_s:.4f} |",
        f"| `DELETE` of its rows (one statement) | {delete_s:.2f} |",
        f"| then `VACUUM` of the emptied day (what reclaims the deleted rows) | {vacuum_s:.2f} |",
        "",
        f"The drop takes {drop_s:.3f} s (target: under {TARGET_DROP_S:.0f} s: {verdict}), "
        f"{delete_s / drop_s:,.1f} × faster than the `DELETE` "
        f"({(delete_s + vacuum_s) / drop_s:,.1f} × with its `VACUUM`).",
    ]
    print("\n".join(lines))
    if args.json:
        write_json(args.json, figures)
    if args.record:
        with RECORD_PATH.open("a") as out:
            out.write("\n" + "\n".join(lines) + "\n")
    return 0 if drop_s < TARGET_DROP_S else 1


def json_figures(drop_s: float, delete_s: float, vacuum_s: float, events: int, size_mb: float) -> dict:
    """Return what ``--json`` writes: each prune's seconds, and the day's size."""
    return {
        "retention_drop_s": round(drop_s, 4),
        "retention_delete_s": round(delete_s, 3),
        "retention_vacuum_s": round(vacuum_s, 3),
        "events_per_day": events,
        "partition_mb": round(size_mb, 1),
        "bytes_per_event": round(size_mb * 2**20 / events),
    }


if __name__ == "__main__":
    sys.exit(main())
