"""What one call costs before any timing: its SQL statements, and its CPU on one quiet thread.

Counts the statements of one service call of each kind and mode, and of one HTTP request of
each kind (in-process, every connection counted), and renders them as the statements table.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

from bench.harness.env import db_params
from bench.harness.fixtures import MAILBOX, http_fixture
from bench.harness.meters import QUIET, process_tree_seconds, wait_for_quiet
from bench.harness.report import markdown_table
from bench.throughput.service import ServiceCalls, ServiceMode


def count_service_statements(modes: list[ServiceMode]) -> dict[str, list[str]]:
    """Capture the SQL of one submit, one claim of 1 and one complete call of each mode.

    Unbatched, that is one ``task_submit``, ``task_claim(max_claims=1)``, one of ``max_claims=B``
    and one ``claim_complete``; batched, one call of each batched size.
    """
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    captured: dict[str, list[str]] = {}
    for index, mode in enumerate(modes):
        (submit_op, _), (claim_op, _), (complete_op, _) = mode.calls
        calls = ServiceCalls(f"statements-{mode.name}", mode)
        tasks = max(mode.submit_batch, mode.claim_max, mode.complete_batch) + 1
        with CaptureQueriesContext(connection) as q:
            calls.submit(list(range(mode.submit_batch)))
        captured[submit_op] = [x["sql"] for x in q.captured_queries]
        calls.submit(list(range(mode.submit_batch, tasks + mode.submit_batch)))
        if index == 0:
            with CaptureQueriesContext(connection) as q:
                first = calls.claim(max_claims=1)
            captured["claim (max 1)"] = [x["sql"] for x in q.captured_queries]
            assert len(first) == 1, len(first)
        with CaptureQueriesContext(connection) as q:
            claims = calls.claim()
        captured[claim_op] = [x["sql"] for x in q.captured_queries]
        assert len(claims) == mode.claim_max, (len(claims), mode.claim_max)
        claims += calls.claim()
        with CaptureQueriesContext(connection) as q:
            calls.complete(claims[: mode.complete_batch])
        captured[complete_op] = [x["sql"] for x in q.captured_queries]
    return captured


def time_service_calls(modes: list[ServiceMode], calls: int = 200) -> tuple[dict[str, tuple[float, float, float]], str]:
    """Cost of each call on one thread, nothing else of ours running: (Python CPU, PostgreSQL CPU, wall) ms.

    Python CPU is this thread's CPU time; PostgreSQL CPU is its backend's, read from /proc.
    Each mode submits, claims and completes at least ``calls`` tasks (10 calls of its largest
    batch at least). Also returns how busy the machine was before the measurement.
    """
    note = wait_for_quiet(**QUIET)
    print(f"per-call costs: {note}", flush=True)
    costs: dict[str, tuple[float, float, float]] = {}
    for mode in modes:
        costs.update(_time_mode_calls(mode, calls))
    return costs, note


def _time_mode_calls(mode: ServiceMode, calls: int) -> dict[str, tuple[float, float, float]]:
    """Time every call of one mode on this thread; see ``time_service_calls``."""
    from django.db import connection

    service = ServiceCalls(f"per-call-{mode.name}", mode)
    connection.ensure_connection()
    backend = connection.connection.info.backend_pid if connection.vendor == "postgresql" else None
    costs: dict[str, tuple[float, float, float]] = {}

    def timed(name: str, count: int, call: Callable[[int], Any]) -> list[Any]:
        results = []
        pg_before = process_tree_seconds(backend) if backend else 0.0
        cpu_before, wall_before = time.thread_time(), time.perf_counter()
        for i in range(count):
            results.append(call(i))
        cpu, wall = time.thread_time() - cpu_before, time.perf_counter() - wall_before
        pg = (process_tree_seconds(backend) - pg_before) if backend else float("nan")
        costs[name] = (1000 * cpu / count, 1000 * pg / count, 1000 * wall / count)
        return results

    sizes = (mode.submit_batch, mode.claim_max, mode.complete_batch)
    tasks = max(calls, 10 * max(sizes))
    tasks += -tasks % math.lcm(*sizes)
    (submit_op, submit), (claim_op, _), (complete_op, complete) = mode.calls
    timed(submit_op, tasks // submit, lambda i: service.submit(list(range(i * submit, (i + 1) * submit))))
    claimed = timed(claim_op, tasks // mode.claim_max, lambda i: service.claim())
    claims = [claim for batch in claimed for claim in batch]
    assert len(claims) == tasks, (len(claims), tasks)
    timed(complete_op, tasks // complete, lambda i: service.complete(claims[i * complete : (i + 1) * complete]))
    return costs


def count_http_statements(batch: int) -> dict[str, tuple[int, int, int]]:
    """Count SQL statements and connections of one request of each kind, in-process.

    Uses Django's test client against the real URL conf and middleware, and counts every
    statement on every connection (the claims view reads and claims in executor threads).
    Connections are counted twice: as Django opens them (``connection_created``, which a
    connection pool also sends for every connection it hands out) and as PostgreSQL starts
    sessions (``pg_stat_database.sessions``, read on a connection of our own).
    """
    import psycopg
    from django.db import connection
    from django.db.backends.signals import connection_created
    from django.test import Client

    _, key = http_fixture("http-statements")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    statements: list[str] = []
    state = {"connections": 0}
    wrapped = []

    def counting(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    def on_connect(sender, connection, **kwargs):
        state["connections"] += 1
        if counting not in connection.execute_wrappers:
            connection.execute_wrappers.append(counting)
            wrapped.append(connection)

    observer = psycopg.connect(**db_params(os.environ["DATABASE_URL"]), autocommit=True)

    def sessions() -> int:
        # A backend reports its session when it first goes idle; give it a moment.
        time.sleep(0.05)
        query = "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        return observer.execute(query).fetchone()[0]

    def measure(method: str, path: str, body: dict) -> tuple[tuple[int, int, int], dict]:
        connection.close()
        statements.clear()
        state["connections"] = 0
        before = sessions()
        response = getattr(client, method)(path, body, content_type="application/json")
        assert response.status_code in (200, 201), (path, response.status_code, response.content[:300])
        connection.close()
        return (len(statements), state["connections"], sessions() - before), response.json()

    counts: dict[str, tuple[int, int, int]] = {}
    connection_created.connect(on_connect, weak=False)
    try:
        counts["PUT /v1/mailboxes/{name}"], _ = measure("put", f"/v1/mailboxes/{MAILBOX}", {"mode": "WORK"})
        counts["POST /v1/runs"], run = measure("post", "/v1/runs", {"name": "statements"})
        submit_path = f"/v1/mailboxes/{MAILBOX}/tasks"
        counts["POST /v1/mailboxes/{name}/tasks"], _ = measure("post", submit_path, {"runId": run["id"], "input": {}})
        for i in range(batch):
            measure("post", submit_path, {"runId": run["id"], "input": {"i": i}})
        claims_path = f"/v1/mailboxes/{MAILBOX}/claims"
        counts[f"POST /v1/mailboxes/{{name}}/claims (max {batch})"], answer = measure(
            "post", claims_path, {"runId": run["id"], "max": batch}
        )
        claim_id = answer["claims"][0]["claimId"]
        counts["POST /v1/claims/{id}/complete"], _ = measure("post", f"/v1/claims/{claim_id}/complete", {"outcome": 1})
    finally:
        observer.close()
        connection_created.disconnect(on_connect)
        for wrapper in wrapped:
            if counting in wrapper.execute_wrappers:
                wrapper.execute_wrappers.remove(counting)
    return counts


def statements_table(
    service: dict[str, list[str]],
    http: dict[str, tuple[int, int, int]] | None,
    modes: list[ServiceMode],
    costs: dict[str, tuple[float, float, float]] | None = None,
    costs_note: str = "",
) -> str:
    """Return the statement-count tables (service layer with per-call costs, and per HTTP request)."""
    costs = costs or {}
    rows = []
    for op, sqls in service.items():
        cost = costs.get(op)
        cells = [f"{c:.2f}" for c in cost] if cost else ["", "", ""]
        rows.append([op, str(len(sqls)), *cells, summarize_sqls(sqls)])
    for mode in modes:
        ops = mode.calls
        per_task = sum(len(service[op]) / size for op, size in ops)
        transactions = sum(sum(1 for sql in service[op] if sql.strip().upper() == "BEGIN") / size for op, size in ops)
        total = ["", "", ""]
        if all(op in costs for op, _ in ops):
            total = [f"{sum(costs[op][k] / size for op, size in ops):.2f}" for k in range(3)]
        rows.append(
            [
                f"per task, {mode.name} (submit/{mode.submit_batch} + claim/{mode.claim_max} + "
                f"complete/{mode.complete_batch})",
                f"{per_task:.2f}",
                *total,
                f"{transactions:.2f} transactions",
            ]
        )
    header = [
        "service call",
        "statements",
        "Python CPU ms",
        "PostgreSQL CPU ms",
        "wall ms",
        "statements in order (BEGIN and COMMIT included)",
    ]
    text = markdown_table(header, rows)
    text += (
        "\n\nCosts per call on one thread with nothing else of ours running "
        "(Python CPU: that thread; PostgreSQL CPU: its backend)" + (f"; {costs_note}." if costs_note else ".")
    )
    if http:
        http_rows = [[op, str(n), str(opened), str(started)] for op, (n, opened, started) in http.items()]
        header = [
            "HTTP request (in-process)",
            "statements (BEGIN/COMMIT not counted)",
            "connections Django opened (or took from its pool)",
            "new PostgreSQL sessions",
        ]
        text += "\n\n" + markdown_table(header, http_rows)
    return text


def summarize_sqls(sqls: list[str], limit: int = 24) -> str:
    """Return the statements' labels in order, a run of the same label as one (``INSERT task (x100)``).

    A batched call can run hundreds of statements; past ``limit`` labels the rest is counted.
    """
    runs: list[list[Any]] = []
    for label in (summarize_sql(sql) for sql in sqls):
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    labels = [label if count == 1 else f"{label} (x{count})" for label, count in runs]
    if len(labels) > limit:
        labels = [*labels[:limit], f"... {len(labels) - limit} more"]
    return ", ".join(labels)


def summarize_sql(sql: str) -> str:
    """Return a short label for one statement, e.g. ``SELECT run FOR KEY SHARE``."""
    text = " ".join(sql.split())
    verb = text.split(" ", 1)[0].upper()
    table = re.search(r'(?:FROM|INTO|UPDATE) "coordination_(\w+)"', text)
    label = f"{verb} {table.group(1)}" if table else verb
    for clause in ("FOR KEY SHARE", "FOR NO KEY UPDATE", "FOR UPDATE SKIP LOCKED", "FOR UPDATE"):
        if clause in text:
            label += f" {clause}"
            break
    if verb == "INSERT" and table:
        label += f" x{text.count('), (') + 1}" if "), (" in text else ""
    return label
