"""TaskGroup carries the condition table's counters (issue 27 item 3), backfilled here.

``accepted_count``, ``rejected_count``, ``acceptable_count`` and ``finished_count`` are
``group_rules.recount`` over ALL members, late verdicts included. Verdicts and member inserts
write them in their own statements; a member task's state change writes them through the
``coordination_task_group_counts`` trigger (PostgreSQL and SQLite alike), so that no path
that ends a member, raw SQL included, can miss them. The trigger updates the group row after
the task row is locked: every writer that changes a member's state holds its group's lock
already (house order: gate, group, task).

Frozen history: the state names and the facts (``still_acceptable``, ``finished``) are
written out as they are in ``coordination.domain.group_rules`` today.
"""

from django.db import migrations, models

TERMINAL = "('CANCELLED', 'EXPIRED', 'FAILED', 'SUCCEEDED')"


def _acceptable(state: str, verdict: str) -> str:
    return f"({state} NOT IN {TERMINAL} OR ({state} = 'SUCCEEDED' AND {verdict} IS NULL))"


def _finished(state: str, verdict: str) -> str:
    return f"({state} IN {TERMINAL} AND ({state} <> 'SUCCEEDED' OR {verdict} IS NOT NULL))"


def _count(where: str) -> str:
    return (
        "(SELECT count(*) FROM coordination_groupmember m JOIN coordination_task t ON t.id = m.task_id "
        f"WHERE m.group_id = coordination_taskgroup.id AND {where})"
    )


BACKFILL = f"""
UPDATE coordination_taskgroup SET
    accepted_count = {_count("m.verdict = 'ACCEPTED'")},
    rejected_count = {_count("m.verdict = 'REJECTED'")},
    acceptable_count = {_count(_acceptable("t.state", "m.verdict"))},
    finished_count = {_count(_finished("t.state", "m.verdict"))}
"""

# Only a change that can move a fact fires the trigger: into or out of the terminal states,
# or into or out of SUCCEEDED. Claims, requeues and cancellation requests do not.
WHEN = (
    f"NEW.group_id IS NOT NULL AND ((OLD.state IN {TERMINAL}) <> (NEW.state IN {TERMINAL})"
    " OR (OLD.state = 'SUCCEEDED') <> (NEW.state = 'SUCCEEDED'))"
)


def _delta(fact, verdict: str) -> str:
    return f"(CAST({fact('NEW.state', verdict)} AS integer) - CAST({fact('OLD.state', verdict)} AS integer))"


POSTGRES_FORWARD = [
    f"""
    CREATE OR REPLACE FUNCTION coordination_task_group_counts() RETURNS trigger AS $$
    DECLARE
        member_verdict text;
    BEGIN
        SELECT verdict INTO member_verdict FROM coordination_groupmember WHERE task_id = NEW.id;
        UPDATE coordination_taskgroup SET
            acceptable_count = acceptable_count + {_delta(_acceptable, "member_verdict")},
            finished_count = finished_count + {_delta(_finished, "member_verdict")}
        WHERE id = NEW.group_id;
        RETURN NULL;
    END;
    $$ LANGUAGE plpgsql
    """,
    f"""
    CREATE TRIGGER coordination_task_group_counts AFTER UPDATE OF state ON coordination_task
    FOR EACH ROW WHEN ({WHEN}) EXECUTE FUNCTION coordination_task_group_counts()
    """,
]
POSTGRES_BACKWARD = [
    "DROP TRIGGER IF EXISTS coordination_task_group_counts ON coordination_task",
    "DROP FUNCTION IF EXISTS coordination_task_group_counts()",
]

_VERDICT_SQLITE = "(SELECT verdict FROM coordination_groupmember WHERE task_id = NEW.id)"
SQLITE_FORWARD = [
    f"""
    CREATE TRIGGER coordination_task_group_counts AFTER UPDATE OF state ON coordination_task
    FOR EACH ROW WHEN {WHEN}
    BEGIN
        UPDATE coordination_taskgroup SET
            acceptable_count = acceptable_count + {_delta(_acceptable, _VERDICT_SQLITE)},
            finished_count = finished_count + {_delta(_finished, _VERDICT_SQLITE)}
        WHERE id = NEW.group_id;
    END
    """
]
SQLITE_BACKWARD = ["DROP TRIGGER IF EXISTS coordination_task_group_counts"]


def _run(statements_by_vendor):
    def run(apps, schema_editor):
        for statement in statements_by_vendor.get(schema_editor.connection.vendor, []):
            schema_editor.execute(statement)

    return run


class Migration(migrations.Migration):
    dependencies = [
        ("coordination", "0017_trace_context"),
    ]

    operations = [
        migrations.AddField(
            model_name="taskgroup",
            name="accepted_count",
            field=models.PositiveSmallIntegerField(default=0, editable=False),
        ),
        migrations.AddField(
            model_name="taskgroup",
            name="rejected_count",
            field=models.PositiveSmallIntegerField(default=0, editable=False),
        ),
        migrations.AddField(
            model_name="taskgroup",
            name="acceptable_count",
            field=models.PositiveSmallIntegerField(default=0, editable=False),
        ),
        migrations.AddField(
            model_name="taskgroup",
            name="finished_count",
            field=models.PositiveSmallIntegerField(default=0, editable=False),
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop),
        migrations.RunPython(
            _run({"postgresql": POSTGRES_FORWARD, "sqlite": SQLITE_FORWARD}),
            _run({"postgresql": POSTGRES_BACKWARD, "sqlite": SQLITE_BACKWARD}),
        ),
    ]
