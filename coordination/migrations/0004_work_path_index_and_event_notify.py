"""PostgreSQL only: subtree indexes for work, and NOTIFY on every event.

The trigger makes every committed event wake the long-polls waiting on it: PostgreSQL
delivers a NOTIFY issued inside a transaction when (and only if) that transaction commits.
The payload is ``"<subject_id> <run_id>"``; waiters listen for either.
"""

from django.db import migrations

from coordination.migrations._postgres import execute_on_postgres

# The row trigger (replaced by 0007's statement trigger, which restores it when unapplied).
ROW_TRIGGER = [
    """
    CREATE OR REPLACE FUNCTION runstate_event_notify() RETURNS trigger AS $$
    BEGIN
        PERFORM pg_notify('runstate', NEW.subject_id || ' ' || coalesce(NEW.run_id::text, ''));
        RETURN NULL;
    END;
    $$ LANGUAGE plpgsql
    """,
    "DROP TRIGGER IF EXISTS runstate_event_notify ON coordination_event",
    "CREATE TRIGGER runstate_event_notify AFTER INSERT ON coordination_event "
    "FOR EACH ROW EXECUTE FUNCTION runstate_event_notify()",
]

FORWARD = [
    "CREATE INDEX IF NOT EXISTS task_unfinished_run_path ON coordination_task (run_path text_pattern_ops) "
    "WHERE state IN ('QUEUED', 'RUNNING', 'CANCELLATION_REQUESTED')",
    "CREATE INDEX IF NOT EXISTS message_unfinished_run_path ON coordination_message (run_path text_pattern_ops) "
    "WHERE state IN ('QUEUED', 'IN_FLIGHT')",
    *ROW_TRIGGER,
]

BACKWARD = [
    "DROP TRIGGER IF EXISTS runstate_event_notify ON coordination_event",
    "DROP FUNCTION IF EXISTS runstate_event_notify()",
    "DROP INDEX IF EXISTS task_unfinished_run_path",
    "DROP INDEX IF EXISTS message_unfinished_run_path",
]


def forward(apps, schema_editor):
    execute_on_postgres(schema_editor, FORWARD)


def backward(apps, schema_editor):
    execute_on_postgres(schema_editor, BACKWARD)


class Migration(migrations.Migration):
    dependencies = [("coordination", "0003_work")]

    operations = [migrations.RunPython(forward, backward)]
