"""PostgreSQL only: the event table becomes partitioned by day of ``created_at`` (issue 30).

Retention then drops a whole day's partition instead of deleting its rows one by one
(``coordination/services/event_partitions.py``). The conversion, in the migration's
transaction (the table is locked throughout; a large log is best pruned first):

1. the plain table, its indexes and its identity sequence are renamed aside;
2. a table of the same columns, ``PARTITION BY RANGE (created_at)``, takes the name, with one
   partition per UTC day that holds events, today's and the next
   ``RUNSTATE_EVENT_PARTITIONS_AHEAD_DAYS`` days', and a DEFAULT partition;
3. every row is copied across (ids kept) and the identity sequence continues where the old
   one stood;
4. the primary key becomes ``(id, created_at)`` (a partitioned table's unique keys must hold
   the partition key; ids still come from one sequence, and no query needs a unique index
   on ``id`` alone: nothing references an event), and the other indexes, foreign keys and
   triggers are created again from the old table's own definitions, on the parent (so on
   every partition, present and future);
5. the old table is dropped.

Django's view is unchanged (``id`` is the model's primary key; no state operation), and
SQLite keeps the plain table. Unapplying converts back the same way.
"""

from datetime import UTC, timedelta

from django.conf import settings
from django.db import migrations
from django.utils import timezone

from coordination.services.event_partitions import DEFAULT_PARTITION, PARENT, partition_of_sql

OLD = "coordination_event_unpartitioned"


def _definitions(cursor, table: str) -> dict:
    """Read what the conversion must create again: indexes, foreign keys, triggers, the sequence's place."""
    cursor.execute(
        "SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i "
        "WHERE i.indrelid = %s::regclass AND NOT i.indisprimary",
        [table],
    )
    # A partitioned table's index reads "ON ONLY <table>": on the new table it is meant for every partition.
    indexes = [(name, sql.replace(" ON ONLY ", " ON ")) for name, sql in cursor.fetchall()]
    cursor.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'f'",
        [table],
    )
    foreign_keys = cursor.fetchall()
    cursor.execute(
        "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal", [table]
    )
    triggers = [row[0] for row in cursor.fetchall()]
    cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [table])
    sequence = cursor.fetchone()[0]
    cursor.execute(f"SELECT last_value, is_called FROM {sequence}")
    last_value, is_called = cursor.fetchone()
    cursor.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'",
        [table],
    )
    primary_key = cursor.fetchone()[0]
    return {
        "indexes": indexes,
        "foreign_keys": foreign_keys,
        "triggers": triggers,
        "sequence": sequence,
        "last_value": last_value,
        "is_called": is_called,
        "primary_key": primary_key,
    }


def _convert(schema_editor, *, partitioned: bool) -> None:
    """Rebuild the event table, partitioned by day or plain, keeping its rows, ids and definitions."""
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = %s::regclass", [PARENT])
        if (cursor.fetchone()[0] == "p") == partitioned:
            return
        found = _definitions(cursor, PARENT)
        cursor.execute(f"ALTER TABLE {PARENT} RENAME TO {OLD}")
        cursor.execute(f"ALTER INDEX {found['primary_key']} RENAME TO {OLD}_pkey")
        for name, _ in found["indexes"]:
            cursor.execute(f"ALTER INDEX {name} RENAME TO {name}_unpartitioned")
        cursor.execute(f"ALTER SEQUENCE {found['sequence']} RENAME TO {OLD}_id_seq")
        if partitioned:
            cursor.execute(
                f"CREATE TABLE {PARENT} (LIKE {OLD} INCLUDING DEFAULTS INCLUDING IDENTITY) PARTITION BY RANGE (created_at)"
            )
            cursor.execute(f"SELECT DISTINCT (created_at AT TIME ZONE 'UTC')::date FROM {OLD}")
            days = {row[0] for row in cursor.fetchall()}
            today = timezone.now().astimezone(UTC).date()
            days |= {today + timedelta(days=n) for n in range(settings.RUNSTATE_EVENT_PARTITIONS_AHEAD_DAYS + 1)}
            for day in sorted(days):
                cursor.execute(partition_of_sql(day))
            cursor.execute(f"CREATE TABLE {DEFAULT_PARTITION} PARTITION OF {PARENT} DEFAULT")
            primary_key = "(id, created_at)"
        else:
            cursor.execute(f"CREATE TABLE {PARENT} (LIKE {OLD} INCLUDING DEFAULTS INCLUDING IDENTITY)")
            primary_key = "(id)"
        # The same columns in the same order (LIKE): rows and their ids go across as they are.
        cursor.execute(f"INSERT INTO {PARENT} SELECT * FROM {OLD}")
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s, %s)", [PARENT, found["last_value"], found["is_called"]]
        )
        cursor.execute(f"ALTER TABLE {PARENT} ADD CONSTRAINT {PARENT}_pkey PRIMARY KEY {primary_key}")
        for _, sql in found["indexes"]:
            cursor.execute(sql)
        for name, definition in found["foreign_keys"]:
            cursor.execute(f"ALTER TABLE {PARENT} ADD CONSTRAINT {name} {definition}")
        # Dropping the old table drops its triggers; the new table gets the same ones.
        cursor.execute(f"DROP TABLE {OLD}")
        for sql in found["triggers"]:
            cursor.execute(sql)
        cursor.execute(f"ANALYZE {PARENT}")


def forward(apps, schema_editor):
    _convert(schema_editor, partitioned=True)


def backward(apps, schema_editor):
    _convert(schema_editor, partitioned=False)


class Migration(migrations.Migration):
    dependencies = [("coordination", "0015_project_staff_groups")]

    operations = [migrations.RunPython(forward, backward)]
