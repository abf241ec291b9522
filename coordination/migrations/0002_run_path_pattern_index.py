"""Index run paths for prefix queries (a subtree is ``path LIKE '<path>%'``)."""

from django.db import migrations


def create_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # text_pattern_ops lets LIKE 'prefix%' use the index whatever the collation.
        schema_editor.execute("CREATE INDEX IF NOT EXISTS run_path_prefix ON coordination_run (path text_pattern_ops)")
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS event_run_path_prefix ON coordination_event (project_id, run_path text_pattern_ops)"
        )
    else:
        schema_editor.execute("CREATE INDEX IF NOT EXISTS run_path_prefix ON coordination_run (path)")


def drop_index(apps, schema_editor):
    schema_editor.execute("DROP INDEX IF EXISTS run_path_prefix")
    schema_editor.execute("DROP INDEX IF EXISTS event_run_path_prefix")


class Migration(migrations.Migration):
    dependencies = [("coordination", "0001_initial")]

    operations = [migrations.RunPython(create_index, drop_index)]
