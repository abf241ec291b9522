"""PostgreSQL only: one NOTIFY per INSERT statement on the event table, not one per row.

0004's row trigger sent ``"<subject_id> <run_id>"`` for every event, so every task event of
a run (claimed, succeeded, ...) woke every claimer waiting on that run, and a cascade of
thousands of events sent thousands of notifications. This statement-level trigger sends the
*distinct* topics of the statement's rows, space separated, in as few payloads as fit under
PostgreSQL's 8,000-byte limit; a statement whose rows carry no topic still sends one empty
payload, so the readers of every event (``ANY_TOPIC``) wake.

Topics of a row (``coordination/plumbing/notify.py`` explains why):

- its ``subject_id`` when not empty;
- its ``run_id`` only for events that make work available on that run or change what a
  claimer or receiver of the run is answered: ``task.submitted``, ``task.requeued``,
  ``message.sent``, ``message.retried`` and every ``run.*`` event.
"""

from importlib import import_module

from django.db import migrations

from coordination.migrations._postgres import execute_on_postgres

# PostgreSQL rejects a payload of 8,000 bytes or more.
PAYLOAD_LIMIT = 8000

FORWARD = [
    f"""
    CREATE OR REPLACE FUNCTION runstate_events_notify() RETURNS trigger AS $$
    DECLARE
        topic text;
        payload text := '';
    BEGIN
        FOR topic IN
            SELECT DISTINCT t.topic
            FROM new_events e
            CROSS JOIN LATERAL (VALUES
                (nullif(e.subject_id, '')),
                (CASE WHEN e.type IN ('task.submitted', 'task.requeued', 'message.sent', 'message.retried')
                        OR starts_with(e.type, 'run.')
                      THEN e.run_id::text END)
            ) AS t(topic)
            WHERE t.topic IS NOT NULL
        LOOP
            IF payload = '' THEN
                payload := topic;
            ELSIF octet_length(payload) + 1 + octet_length(topic) < {PAYLOAD_LIMIT} THEN
                payload := payload || ' ' || topic;
            ELSE
                PERFORM pg_notify('runstate', payload);
                payload := topic;
            END IF;
        END LOOP;
        -- An empty payload here means no row had a topic: still one notification (for
        -- ANY_TOPIC), unless the statement inserted nothing at all.
        IF payload <> '' OR EXISTS (SELECT 1 FROM new_events) THEN
            PERFORM pg_notify('runstate', payload);
        END IF;
        RETURN NULL;
    END;
    $$ LANGUAGE plpgsql
    """,
    "DROP TRIGGER IF EXISTS runstate_events_notify ON coordination_event",
    "CREATE TRIGGER runstate_events_notify AFTER INSERT ON coordination_event "
    "REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION runstate_events_notify()",
    # 0004's row trigger.
    "DROP TRIGGER IF EXISTS runstate_event_notify ON coordination_event",
    "DROP FUNCTION IF EXISTS runstate_event_notify()",
]

BACKWARD = [
    *import_module("coordination.migrations.0004_work_path_index_and_event_notify").ROW_TRIGGER,
    "DROP TRIGGER IF EXISTS runstate_events_notify ON coordination_event",
    "DROP FUNCTION IF EXISTS runstate_events_notify()",
]


def forward(apps, schema_editor):
    execute_on_postgres(schema_editor, FORWARD)


def backward(apps, schema_editor):
    execute_on_postgres(schema_editor, BACKWARD)


class Migration(migrations.Migration):
    dependencies = [("coordination", "0006_barriers_timers")]

    operations = [migrations.RunPython(forward, backward)]
