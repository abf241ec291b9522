"""Raw SQL for migration steps that only PostgreSQL runs (triggers, operator classes).

Not a migration itself: Django's loader skips modules whose name starts with ``_``.
"""


def execute_on_postgres(schema_editor, statements: list[str]) -> None:
    """Execute ``statements`` in order on PostgreSQL; do nothing on another database."""
    if schema_editor.connection.vendor == "postgresql":
        for statement in statements:
            schema_editor.execute(statement)
