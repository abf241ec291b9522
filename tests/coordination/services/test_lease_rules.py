"""Each claim and lease rule says the same thing in all its forms (``claims.leases``).

The single statements render a rule as SQL, the careful path calls it on the row it locked,
the careful claim and the sweeps filter with it. Here every rule is evaluated in each of its
forms on a table of tasks covering its inputs (every state; each time unset, past, exactly
now and ahead; group member or not; attempts left or not), and the answers must agree row by
row. PostgreSQL only: the SQL form is PostgreSQL's.
"""

import itertools
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from coordination.domain.ids import uuid7
from coordination.domain.states import TaskState
from coordination.models import Task
from coordination.services.claims.leases import CLAIM_HOLDS, CLAIMABLE, EXPIRY_DUE, RUN_DEADLINE_AHEAD, TAKEOVER_DUE
from coordination.services.groups import group_create
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from coordination.services.runs import run_create
from coordination.services.tasks import task_submit

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]


@pytest.fixture
def table():
    """Return ``(now, tasks)``: one saved task per combination of the rules' inputs."""
    project = project_ensure(name="lease-rules")
    mailbox, _ = mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    run = run_create(project_id=project.id)
    base, _ = task_submit(project_id=project.id, mailbox=mailbox, run_id=run.id, input={})
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL", parent_scope_id=run.id)
    now = timezone.now()
    times = (None, now - timedelta(seconds=5), now, now + timedelta(seconds=5))
    fields = {field.attname: getattr(base, field.attname) for field in Task._meta.concrete_fields}
    tasks = []
    lease_inputs = itertools.product(TaskState, times, times, (None, group.id), ((1, 3), (3, 3)), times)
    for state, lease, grace, group_id, (attempts, max_attempts), deadline in lease_inputs:
        tasks.append(
            Task(
                **{
                    **fields,
                    "id": uuid7(),
                    "state": state,
                    "lease_expires_at": lease,
                    "cancel_grace_until": grace,
                    "group_id": group_id,
                    "attempts": attempts,
                    "max_attempts": max_attempts,
                    "run_deadline": deadline,
                }
            )
        )
    for state, available, expires in itertools.product(TaskState, times[1:], times):
        tasks.append(
            Task(**{**fields, "id": uuid7(), "state": state, "available_at": available, "expires_at": expires})
        )
    Task.objects.bulk_create(tasks)
    return now, tasks


def _sql_holds(rule, now, tasks: list[Task], attempt: int = 0) -> set[uuid.UUID]:
    condition = rule.sql("t", attempt="%(attempt)s")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT t.id FROM coordination_task t WHERE t.id = ANY(%(ids)s) AND coalesce(({condition}), false)",
            {"ids": [task.id for task in tasks], "now": now, "attempt": attempt},
        )
        return {row[0] for row in cursor.fetchall()}


@pytest.mark.parametrize(
    "name, rule, with_q",
    [
        ("CLAIMABLE", CLAIMABLE, True),
        ("TAKEOVER_DUE", TAKEOVER_DUE, True),
        ("EXPIRY_DUE", EXPIRY_DUE, True),
        ("RUN_DEADLINE_AHEAD", RUN_DEADLINE_AHEAD, False),
    ],
)
def test_python_sql_and_orm_forms_agree(table, name, rule, with_q):
    now, tasks = table
    by_python = {task.id for task in tasks if rule(task, now)}
    assert 0 < len(by_python) < len(tasks), f"{name}: the table must hold cases either way"
    assert _sql_holds(rule, now, tasks) == by_python, name
    if with_q:
        by_orm = set(
            Task.objects.filter(id__in=[task.id for task in tasks]).filter(rule.q(now)).values_list("id", flat=True)
        )
        assert by_orm == by_python, name


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_the_fence_agrees_in_python_and_sql(table, attempt):
    now, tasks = table
    by_python = {task.id for task in tasks if CLAIM_HOLDS(task, now, attempt=attempt)}
    by_sql = _sql_holds(CLAIM_HOLDS, now, tasks, attempt)
    assert by_sql == by_python
    assert by_python or attempt == 2  # attempts are 1 or 3 in the table


def test_the_rules_are_what_the_statements_use():
    """The statements and the careful path read the rules from ``leases``; no second copy of them exists."""
    from coordination.services.claims import statements

    assert TAKEOVER_DUE.sql("x") in statements.CLAIM_SQL
    assert CLAIMABLE.sql("q") in statements.CLAIM_SQL
    assert CLAIMABLE.sql() in statements.CLAIM_BY_ID_SQL
    for statement in (statements.RENEW_SQL, statements.COMPLETE_SQL, statements.FAIL_SQL):
        assert CLAIM_HOLDS.sql(attempt="%(attempt)s") in statement
        assert RUN_DEADLINE_AHEAD.sql() in statement
    for statement in (statements.COMPLETE_MANY_SQL, statements.RENEW_MANY_SQL):
        assert CLAIM_HOLDS.sql(attempt="i.attempt") in statement
