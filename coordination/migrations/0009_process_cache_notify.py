"""PostgreSQL only: tell every API process when an API key or a mailbox changes.

API processes keep API keys and mailboxes in a per-process cache (``coordination/
process_cache.py``) so that a request does not read them again. These triggers send
``NOTIFY runstate_cache, '<id>'`` when a row is updated or deleted, and ``'*'`` when the
table is truncated; each process's LISTEN connection drops the entry, so a revoked key is
refused everywhere as soon as the revoke commits. A notification is delivered only if the
transaction commits, like the change itself.
"""

from django.db import migrations

from coordination.migrations._postgres import execute_on_postgres

TABLES = ("coordination_apikey", "coordination_mailbox")

FORWARD = [
    """
    CREATE OR REPLACE FUNCTION runstate_cache_notify_row() RETURNS trigger AS $$
    BEGIN
        PERFORM pg_notify('runstate_cache', OLD.id::text);
        RETURN NULL;
    END;
    $$ LANGUAGE plpgsql
    """,
    """
    CREATE OR REPLACE FUNCTION runstate_cache_notify_all() RETURNS trigger AS $$
    BEGIN
        PERFORM pg_notify('runstate_cache', '*');
        RETURN NULL;
    END;
    $$ LANGUAGE plpgsql
    """,
]
for table in TABLES:
    FORWARD += [
        f"""
        CREATE TRIGGER {table}_cache_notify AFTER UPDATE OR DELETE ON {table}
        FOR EACH ROW EXECUTE FUNCTION runstate_cache_notify_row()
        """,
        f"""
        CREATE TRIGGER {table}_cache_notify_truncate AFTER TRUNCATE ON {table}
        FOR EACH STATEMENT EXECUTE FUNCTION runstate_cache_notify_all()
        """,
    ]

BACKWARD = [
    *(f"DROP TRIGGER IF EXISTS {table}_cache_notify ON {table}" for table in TABLES),
    *(f"DROP TRIGGER IF EXISTS {table}_cache_notify_truncate ON {table}" for table in TABLES),
    "DROP FUNCTION IF EXISTS runstate_cache_notify_row()",
    "DROP FUNCTION IF EXISTS runstate_cache_notify_all()",
]


class Migration(migrations.Migration):
    dependencies = [("coordination", "0008_drop_covered_fk_indexes")]

    operations = [
        migrations.RunPython(
            lambda apps, schema_editor: execute_on_postgres(schema_editor, FORWARD),
            lambda apps, schema_editor: execute_on_postgres(schema_editor, BACKWARD),
        )
    ]
