"""The ``coordination_task_group_counts`` trigger is in place and moves a group's counters on any state write.

SQLite drops a table's triggers when a migration rebuilds the table, so a future migration
that alters ``coordination_task`` there must create the trigger again: this fails at once if
one forgets, on either database, without waiting for the group state machine to notice.
"""

import pytest
from django.db import connection

from coordination.models import Task, TaskGroup
from coordination.services.groups import group_create, group_submit
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure
from tests.group_counts import assert_counts_match, stored_counts

pytestmark = pytest.mark.django_db

TRIGGER = "coordination_task_group_counts"


def test_the_trigger_exists_after_every_migration():
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT tgrelid::regclass::text FROM pg_trigger WHERE tgname = %s", [TRIGGER])
        else:
            cursor.execute("SELECT tbl_name FROM sqlite_master WHERE type = 'trigger' AND name = %s", [TRIGGER])
        assert cursor.fetchall() == [(Task._meta.db_table,)]


def test_a_state_written_by_plain_sql_moves_the_counters():
    """No service runs here: an ``UPDATE`` of members' states alone moves the counters, as a recount says."""
    project = project_ensure(name="trigger")
    mailbox_ensure(project_id=project.id, name="jobs", mode="WORK")
    group = group_create(project_id=project.id, mailbox_name="jobs", condition="ALL_TERMINAL")
    members = [group_submit(project_id=project.id, group_id=group.id, input={"n": n})[0] for n in range(3)]
    assert stored_counts(group.id) == {
        "member_count": 3,
        "accepted_count": 0,
        "rejected_count": 0,
        "acceptable_count": 3,
        "finished_count": 0,
    }

    Task.objects.filter(id__in=[members[0].id, members[1].id]).update(state="CANCELLED")
    Task.objects.filter(id=members[2].id).update(state="SUCCEEDED")

    assert stored_counts(group.id) == {
        "member_count": 3,
        "accepted_count": 0,
        "rejected_count": 0,
        "acceptable_count": 1,  # the SUCCEEDED one, unjudged
        "finished_count": 2,
    }
    assert_counts_match(group.id)
    assert TaskGroup.objects.get(id=group.id).state == "OPEN"  # counters only: deciding is the services'
