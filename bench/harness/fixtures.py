"""The benchmarks' projects, keys, mailbox and run, and the one-query check that a run drained exactly once."""

from __future__ import annotations

import uuid
from typing import Any

MAILBOX = "bench"


def verify_run(run_id: uuid.UUID, expected: int) -> dict[str, Any]:
    """One query: every task of the run SUCCEEDED exactly once (attempts 1, one event each)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT count(*),
                   count(*) FILTER (WHERE state = 'SUCCEEDED' AND attempts = 1),
                   (SELECT count(*) FROM coordination_event e
                     WHERE e.run_id = %s AND e.type = 'task.succeeded'),
                   (SELECT count(DISTINCT e.subject_id) FROM coordination_event e
                     WHERE e.run_id = %s AND e.type = 'task.succeeded')
              FROM coordination_task WHERE run_id = %s
            """,
            [run_id, run_id, run_id],
        )
        total, succeeded_once, events, distinct = cursor.fetchone()
    ok = total == succeeded_once == events == distinct == expected
    return {
        "tasks": total,
        "succeeded_attempt_1": succeeded_once,
        "succeeded_events": events,
        "distinct_subjects": distinct,
        "ok": ok,
    }


def verification_text(v: dict[str, Any], expected: int) -> str:
    """Return the one-line verification verdict."""
    verdict = "OK" if v["ok"] else "FAILED"
    return (
        f"verify {verdict}: {v['tasks']}/{expected} tasks, {v['succeeded_attempt_1']} SUCCEEDED with attempts=1, "
        f"{v['succeeded_events']} task.succeeded events on {v['distinct_subjects']} distinct tasks"
    )


def service_fixture(label: str):
    """Create a fresh project, WORK mailbox and run; return them."""
    from coordination.services.keys import project_ensure
    from coordination.services.mailboxes import mailbox_ensure
    from coordination.services.runs import run_create

    project = project_ensure(name=f"bench-{label}-{uuid.uuid4().hex[:8]}")
    mailbox, _ = mailbox_ensure(project_id=project.id, name=MAILBOX, mode="WORK")
    run = run_create(project_id=project.id, name=f"bench {label}")
    return project, mailbox, run


def http_fixture(label: str) -> tuple[Any, str]:
    """Create a fresh project and an all-permissions API key; return (project, plaintext key)."""
    from coordination.services.keys import ALL_PERMISSIONS, api_key_create, project_ensure

    project = project_ensure(name=f"bench-{label}-{uuid.uuid4().hex[:8]}")
    issued = api_key_create(project_id=project.id, permissions=list(ALL_PERMISSIONS), name="bench")
    return project, issued.plaintext
