"""PostgreSQL only: the event trigger's notifications also carry the topic ``claims.held``.

An event that names a held claim (``data ? 'heldBy'``: a cancel, a run or group end, a
deadline or a lease that ran out, stopping a claim its worker did not end itself; see
``services/task_transitions.held_event_data``) adds the constant topic ``claims.held``
(``plumbing.notify.HELD_TOPIC``) to its statement's notification. The claim watches' feed
(``api/sse.py``) wakes on that topic only, not on every event: a drain's claims and
completions, which name no held claim, no longer make every API process with a watch open
read the log. 0007's function otherwise unchanged; the trigger is the same.
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
                      THEN e.run_id::text END),
                (CASE WHEN e.data ? 'heldBy' THEN 'claims.held' END)
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
]


def forward(apps, schema_editor):
    execute_on_postgres(schema_editor, FORWARD)


def backward(apps, schema_editor):
    execute_on_postgres(
        schema_editor, import_module("coordination.migrations.0007_event_notify_per_statement").FORWARD[:1]
    )


class Migration(migrations.Migration):
    dependencies = [("coordination", "0019_event_held_by")]

    operations = [migrations.RunPython(forward, backward)]
