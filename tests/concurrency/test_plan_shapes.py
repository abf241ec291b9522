"""The planner keeps the fair gate before every row lock of the single-statement paths.

The house lock order (``docs/internals.md``, "The fair gate") holds on the fast paths only
while PostgreSQL evaluates the gate (the run chain's ``pg_advisory_xact_lock...`` calls) once,
before the statement locks or changes any row. Nothing in the SQL forces that: it is the
planner's choice, made from the statistics. So each statement is explained here on a database
with realistic row counts and fresh statistics, its text and parameters taken from the very
call the service makes (a wrapper intercepts the statement, explains it instead of running
it, and stops the call; what the call ran before it is rolled back with the test), both as
planned for its parameters (a custom plan) and as planned once for any parameters (the
generic plan a prepared statement may switch to; settings prepare the hot statements). See
``assert_gate_first`` for the rule, and ``CASES`` for the statements and the index each must
scan.
"""

import random
import re
import uuid
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.apps import apps
from django.db import connection, transaction
from django.utils import timezone
from psycopg import pq
from psycopg.adapt import PyFormat

from coordination.domain.ids import uuid7
from coordination.domain.states import GroupCondition, PoolLeaseState, RunState, TaskState
from coordination.models import Budget, Pool, PoolLease, Quota, Run, Task, TaskGroup
from coordination.services import budgets, claims, groups, pools, quotas, runs, tasks
from coordination.services import sql as service_sql
from coordination.services.keys import project_ensure
from coordination.services.mailboxes import mailbox_ensure

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db]

GATE_FUNCTIONS = ("pg_advisory_xact_lock(", "pg_advisory_xact_lock_shared(")
# Nodes that lock or change rows: the gate must have run before any of them acts.
LOCKING_NODES = ("LockRows", "ModifyTable")

ROOTS, CHILDREN, GRANDCHILDREN = 12, 12, 14  # 12 + 144 + 2016 runs
TASKS = 36_000
MAILBOXES = 4
OTHER_PROJECTS = 24  # owning pools and quotas


# The world ---------------------------------------------------------------------------------


@dataclass
class World:
    project_id: uuid.UUID
    mailboxes: list
    run: Run  # a grandchild with queued work in mailboxes[0]
    queued_task: Task
    group: TaskGroup
    pool: Pool
    lease: PoolLease
    quota: Quota
    budget: Budget
    other_run: Run  # a leaf under no group, for a cancel


@pytest.fixture(scope="module")
def world(django_db_setup, django_db_blocker):
    """Thousands of runs in a tree, tens of thousands of tasks, groups, pools, quotas, budgets; analyzed."""
    rng = random.Random(26)
    with django_db_blocker.unblock():
        with transaction.atomic():
            built = _build(rng)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        yield built
        # The rows were committed: empty runstate's own tables for the tests after these. Not
        # ``flush``: it would also empty the rows migrations wrote in other apps' tables (the
        # periodic sweeps in django-celery-beat's), which later tests read.
        tables = [
            model._meta.db_table for model in apps.get_app_config("coordination").get_models(include_auto_created=True)
        ]
        with connection.cursor() as cursor:
            cursor.execute(f"TRUNCATE {', '.join(connection.ops.quote_name(table) for table in tables)} CASCADE")


def _build(rng: random.Random) -> World:
    now = timezone.now()
    project = project_ensure(name="plans")
    other = project_ensure(name="plans-other")
    mailboxes = [mailbox_ensure(project_id=project.id, name=f"mb{i}", mode="WORK")[0] for i in range(MAILBOXES)]
    mailboxes.append(mailbox_ensure(project_id=other.id, name="mb", mode="WORK")[0])

    runs_, leaves = [], []

    def add_run(parent: Run | None, depth: int, project_id) -> Run:
        run_id = uuid7()
        state = RunState.ACTIVE if rng.random() < 0.8 else rng.choice([RunState.CANCELLED, RunState.COMPLETED])
        run = Run(
            id=run_id,
            project_id=project_id,
            parent=parent,
            path=Run.path_for(run_id, parent.path if parent else ""),
            depth=depth,
            stored_state=state,
            deadline=now + timedelta(hours=1) if rng.random() < 0.2 else None,
            created_at=now,
        )
        runs_.append(run)
        return run

    for r in range(ROOTS):
        root = add_run(None, 0, other.id if r == ROOTS - 1 else project.id)
        root.stored_state = RunState.ACTIVE
        for _ in range(CHILDREN):
            child = add_run(root, 1, root.project_id)
            for _ in range(GRANDCHILDREN):
                leaves.append(add_run(child, 2, root.project_id))
    # The runs these statements work under are active all the way up.
    run, other_run = leaves[5], leaves[40]
    for chosen in (run, other_run):
        for ancestor in runs_:
            if chosen.path.startswith(ancestor.path):
                ancestor.stored_state, ancestor.deadline = RunState.ACTIVE, None
    Run.objects.bulk_create(runs_, batch_size=2000)

    by_id = {r.id: r for r in runs_}
    states = [TaskState.SUCCEEDED] * 55 + [TaskState.QUEUED] * 25 + [TaskState.RUNNING] * 10
    states += [TaskState.FAILED] * 6 + [TaskState.CANCELLED] * 4
    task_rows = []
    for i in range(TASKS):
        leaf = run if i % 40 == 0 else leaves[rng.randrange(len(leaves))]
        mailbox = mailboxes[-1] if leaf.project_id == other.id else mailboxes[rng.randrange(MAILBOXES)]
        state = rng.choice(states)
        held = state == TaskState.RUNNING
        task_rows.append(
            Task(
                id=uuid7(),
                project_id=leaf.project_id,
                mailbox=mailbox,
                run_id=leaf.id,
                run_path=leaf.path,
                key=f"k{i}" if i % 3 == 0 else None,
                input={"i": i},
                state=state,
                attempts=0 if state == TaskState.QUEUED else 1,
                priority=rng.randrange(3),
                created_at=now - timedelta(seconds=TASKS - i),
                available_at=now - timedelta(seconds=TASKS - i),
                lease_expires_at=now + timedelta(minutes=5) if held else None,
                worker_id="w" if held else "",
                finished_at=None if state in (TaskState.QUEUED, TaskState.RUNNING) else now,
            )
        )
    for task in task_rows[:: TASKS // 20]:  # work of the chosen run waiting in its mailbox
        task.run_id, task.run_path, task.mailbox, task.state = run.id, run.path, mailboxes[0], TaskState.QUEUED
        task.project_id, task.attempts, task.lease_expires_at, task.worker_id, task.finished_at = (
            project.id,
            0,
            None,
            "",
            None,
        )
    Task.objects.bulk_create(task_rows, batch_size=4000)
    queued_task = next(t for t in task_rows if t.run_id == run.id and t.state == TaskState.QUEUED)

    gated = [leaf for leaf in leaves if leaf.project_id == project.id and leaf not in (run, other_run)][:300]
    group_rows = [
        TaskGroup(
            project_id=project.id,
            mailbox=mailboxes[i % MAILBOXES],
            scope=scope,
            parent_scope=by_id[scope.parent_id],
            condition=GroupCondition.ALL_TERMINAL,
            created_at=now,
        )
        for i, scope in enumerate(gated)
    ]
    TaskGroup.objects.bulk_create(group_rows)

    # Pools and quotas of many projects, as on a shared server.
    owners = [project.id] + [project_ensure(name=f"plans-{i}").id for i in range(OTHER_PROJECTS)]
    pool_rows = [Pool(project_id=owner, name=f"pool{i}", capacity=1000) for owner in owners for i in range(40)]
    Pool.objects.bulk_create(pool_rows)
    lease_rows = []
    for i in range(3000):
        leaf = leaves[rng.randrange(len(leaves))] if i else run
        lease_rows.append(
            PoolLease(
                project_id=project.id,
                pool=pool_rows[i % len(pool_rows)],
                run_id=leaf.id,
                run_path=leaf.path,
                units=1,
                lease_ttl_ms=60_000,
                state=PoolLeaseState.HELD if i % 4 == 0 else PoolLeaseState.RELEASED,
                arrival=i,
                expires_at=now + timedelta(minutes=10),
            )
        )
    PoolLease.objects.bulk_create(lease_rows)

    quota_rows = [
        Quota(project_id=owner, name=f"quota{i}", limit=100, period_ms=1000, level_micro=0, level_at=now)
        for owner in owners
        for i in range(40)
    ]
    Quota.objects.bulk_create(quota_rows)

    budget_rows = [
        Budget(project_id=r.project_id, run_id=r.id, run_path=r.path, name=name, limit=10**9)
        for r in runs_
        if r.depth < 2 or rng.random() < 0.2
        for name in ("tokens", "dollars")
    ]
    budget_rows += [Budget(project_id=project.id, run_id=run.id, run_path=run.path, name="tokens", limit=10**9)]
    budget_rows = list({(b.run_id, b.name): b for b in budget_rows}.values())
    Budget.objects.bulk_create(budget_rows)
    budget = next(b for b in budget_rows if b.run_id == run.id and b.name == "tokens")

    return World(
        project_id=project.id,
        mailboxes=mailboxes,
        run=run,
        queued_task=queued_task,
        group=next(g for g in group_rows if g.mailbox_id == mailboxes[0].id),
        pool=pool_rows[0],
        lease=lease_rows[0],
        quota=quota_rows[0],
        budget=budget,
        other_run=other_run,
    )


# Explaining the statement a service call makes --------------------------------------------


class _Explained(Exception):
    """Raised in place of running the intercepted statement: the call stops there."""


def explain_call(call, matches, *, generic: bool) -> list:
    """Run ``call`` up to its first statement that ``matches``; return that statement's plan (JSON).

    Statements before it run as usual; it is explained, not run, and the call is stopped.
    """
    plans = []

    def wrapper(execute, sql, params, many, context):
        if plans or not matches(sql):
            return execute(sql, params, many, context)
        cursor = context["cursor"]
        if generic:
            plans.append(_explain_generic(cursor.cursor, sql, params))
        else:
            execute(f"EXPLAIN (FORMAT JSON, VERBOSE) {sql}", params, many, context)
            plans.append(cursor.fetchone()[0])
        raise _Explained

    with connection.execute_wrapper(wrapper), pytest.raises(_Explained):
        with transaction.atomic():
            call()
    return plans[0]


def _explain_generic(raw_cursor, sql: str, params) -> list:
    """Explain ``sql`` as a prepared statement planned for any parameters (the generic plan).

    The parameters get the types psycopg sends them with (server-side binding), so the
    statement is typed as the prepared one the service runs.
    """
    names: list = []

    def placeholder(match):
        if match.group(0) == "%%":
            return "%"
        key = match.group(1) if match.group(1) is not None else len(names)
        if key not in names:
            names.append(key)
        return f"${names.index(key) + 1}"

    text = re.sub(r"%%|%\((\w+)\)s|%s", placeholder, sql)
    values = [params[key] for key in names]
    adapters = raw_cursor.adapters
    oids = []
    for value in values:
        if value is None:
            oids.append(0)
            continue
        dumper = adapters.get_dumper(type(value), PyFormat.AUTO)(type(value), raw_cursor.connection)
        oids.append(dumper.upgrade(value, PyFormat.AUTO).oid)
    name = f"plan_shape_{uuid.uuid4().hex}"
    # Parsed as psycopg parses the statement it prepares: the same text, the same types.
    result = raw_cursor.connection.pgconn.prepare(name.encode(), text.encode(), oids)
    assert result.status == pq.ExecStatus.COMMAND_OK, result.error_message.decode()
    raw_cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    # A generic plan does not depend on the values: NULLs stand for them.
    arguments = f"({', '.join('NULL' for _ in values)})" if values else ""
    raw_cursor.execute(f"EXPLAIN (FORMAT JSON, VERBOSE) EXECUTE {name}{arguments}")
    plan = raw_cursor.fetchone()[0]
    raw_cursor.execute(f"DEALLOCATE {name}")
    raw_cursor.execute("RESET plan_cache_mode")
    return plan


# The statements -----------------------------------------------------------------------------


def _orm_chain_lock(mode: str):
    """Match ``locking._lock_runs``'s statement: the run rows locked in ``mode`` behind the gate."""
    return lambda sql: any(f in sql for f in GATE_FUNCTIONS) and sql.rstrip().endswith(mode)


def _submit_batch(world, specs) -> None:
    """Run the hot path's batch submit statement on Django's connection (the API runs it on its async pool)."""
    now = timezone.now()
    mailbox = world.mailboxes[0]
    built, _ = tasks.submit_many_prepared(
        project_id=world.project_id, mailbox=mailbox, run_id=world.run.id, items=specs, now=now
    )
    service_sql.fetch(*tasks.submit_many_statement(built, mailbox, now))


@dataclass(frozen=True)
class Case:
    call: object  # (world) -> None: the service call that makes the statement
    matches: object  # (sql) -> bool: the statement
    indexes: tuple[str, ...]  # each must be scanned (Index Scan / Index Only Scan / Bitmap Index Scan)


CASES = {
    "claim (CLAIM_SQL)": Case(
        lambda w: claims.task_claim(
            project_id=w.project_id, mailbox=w.mailboxes[0], run_id=w.run.id, worker_id="w", max_claims=10
        ),
        lambda sql: sql == claims.CLAIM_SQL,
        ("coordination_run_pkey", "task_claimable", "coordination_task_pkey"),
    ),
    "claim by id (CLAIM_BY_ID_SQL)": Case(
        lambda w: claims.task_claim_by_id(project_id=w.project_id, task_id=w.queued_task.id, worker_id="w"),
        lambda sql: sql == claims.CLAIM_BY_ID_SQL,
        ("coordination_task_pkey", "coordination_run_pkey"),
    ),
    "submit (SUBMIT_SQL)": Case(
        lambda w: tasks.task_submit(
            project_id=w.project_id, mailbox=w.mailboxes[0], run_id=w.run.id, input={"n": 1}, key="plan"
        ),
        lambda sql: sql == tasks.SUBMIT_SQL,
        ("coordination_run_pkey", "coordination_taskgroup_scope_id_key"),
    ),
    "submit many: chain lock before SUBMIT_MANY_SQL": Case(
        lambda w: tasks.tasks_submit_many(
            project_id=w.project_id,
            mailbox=w.mailboxes[0],
            run_id=w.run.id,
            items=[tasks.TaskSpec(input={"i": i}) for i in range(3)],
        ),
        _orm_chain_lock("FOR KEY SHARE"),
        ("coordination_run_pkey",),
    ),
    "submit batch, the hot path's (SUBMIT_BATCH_SQL)": Case(
        lambda w: _submit_batch(w, [tasks.TaskSpec(input={"i": i}, key=f"plan-batch-{i}") for i in range(3)]),
        lambda sql: sql == tasks.SUBMIT_BATCH_SQL,
        ("coordination_run_pkey", "coordination_taskgroup_scope_id_key"),
    ),
    "group gate lock (GATE_AND_GROUP_LOCK_SQL)": Case(
        lambda w: groups.group_lock(group_id=w.group.id, project_id=w.project_id),
        lambda sql: sql == groups.GATE_AND_GROUP_LOCK_SQL,
        ("coordination_run_pkey", "coordination_taskgroup_pkey"),
    ),
    "pool acquire (pools.ACQUIRE_SQL)": Case(
        lambda w: pools.pool_acquire(project_id=w.project_id, name=w.pool.name, run_id=w.run.id),
        lambda sql: sql == pools.ACQUIRE_SQL,
        ("coordination_run_pkey", "pool_name_per_project"),
    ),
    "pool lease renew (pools.RENEW_SQL)": Case(
        lambda w: pools.pool_lease_renew(project_id=w.project_id, lease_id=w.lease.id),
        lambda sql: sql == pools.RENEW_SQL,
        ("coordination_poollease_pkey", "coordination_run_pkey"),
    ),
    "quota take (quotas.TAKE_SQL)": Case(
        lambda w: quotas.quota_take(project_id=w.project_id, run_id=w.run.id, name=w.quota.name),
        lambda sql: sql == quotas.TAKE_SQL,
        ("coordination_run_pkey", "quota_project_name"),
    ),
    "budget reserve: chain lock (locking.run_chain_lock)": Case(
        lambda w: budgets.reservation_create(project_id=w.project_id, run_id=w.run.id, budget="tokens", amount=1),
        _orm_chain_lock("FOR KEY SHARE"),
        ("coordination_run_pkey",),
    ),
    "run cancel: exclusive chain lock (locking.run_chain_lock)": Case(
        lambda w: runs.run_cancel(project_id=w.project_id, run_id=w.other_run.id),
        _orm_chain_lock("FOR UPDATE"),
        ("coordination_run_pkey",),
    ),
}


# The rule ------------------------------------------------------------------------------------


def _nodes(node):
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def _row_sources(node) -> list:
    """The children a node reads rows from (not its InitPlans, CTEs or SubPlans)."""
    return [c for c in node.get("Plans", []) if c.get("Parent Relationship") not in ("InitPlan", "SubPlan")]


def _computes_gate(node) -> bool:
    return any(f in item for item in node.get("Output", []) for f in GATE_FUNCTIONS)


def _reads(node, subplan_name: str) -> bool:
    """Tell whether ``node``'s output or filter reads ``subplan_name`` (so it yields no row before running it)."""
    texts = [*node.get("Output", []), node.get("Filter", ""), node.get("One-Time Filter", "")]
    return any(f"({subplan_name})" in text for text in texts)


class _Plan:
    def __init__(self, plan: list):
        self.root = plan[0]["Plan"]
        self.ctes, self.params = {}, {}
        for node in _nodes(self.root):
            name = node.get("Subplan Name", "")
            if name.startswith("CTE "):
                self.ctes[name[4:]] = node
            for param in re.findall(r"\$\d+", name.partition("returns")[2]):
                self.params[param] = node

    def gated(self, node) -> bool:
        """Tell whether ``node`` yields no row before the gate has run (it may yield none at all).

        True for:
        * the node computing the gate (an aggregate over the lock calls yields its row only
          after making them);
        * a node whose output or filter reads a gated SubPlan;
        * a Result whose One-Time Filter reads a gated InitPlan (PostgreSQL evaluates it
          before fetching the first row from below);
        * a CTE Scan of a gated CTE;
        * an inner join with a gated input (it yields a row only with one from each side);
        * any other node whose single row source is gated.
        """
        if _computes_gate(node):
            return True
        one_time = node.get("One-Time Filter", "")
        if any(self.gated(self.params[p]) for p in re.findall(r"\$\d+", one_time) if p in self.params):
            return True
        for child in node.get("Plans", []):
            if child.get("Parent Relationship") == "SubPlan" and _reads(node, child["Subplan Name"]):
                if self.gated(child):
                    return True
        if node["Node Type"] == "CTE Scan":
            return self.gated(self.ctes[node["CTE Name"]])
        sources = _row_sources(node)
        if "Join Type" in node:
            return node["Join Type"] == "Inner" and any(self.gated(source) for source in sources)
        return len(sources) == 1 and self.gated(sources[0])


def assert_gate_first(plan: list) -> None:
    """Assert that the fair gate runs once, before any row is locked or changed.

    The plan must compute the gate (the ``pg_advisory_xact_lock...`` calls), each time in an
    InitPlan (a one-time subquery, evaluated once when its value is first needed: not a CTE,
    not per row of a scan; SubPlans inside the InitPlan are allowed), and every ``LockRows``
    and ``ModifyTable`` node (the only nodes that lock or change rows) must be gated
    (``_Plan.gated``): no row reaches it before the gate has run.
    """
    shape = _Plan(plan)
    gates = [node for node in _nodes(shape.root) if _computes_gate(node)]
    assert gates, "the plan computes no fair gate"

    def enclosing_plans(node, target, names=()) -> tuple | None:
        """The Subplan Names from the root down to ``target`` (itself included)."""
        names = (*names, node["Subplan Name"]) if "Subplan Name" in node else names
        if node is target:
            return names
        for child in node.get("Plans", []):
            found = enclosing_plans(child, target, names)
            if found is not None:
                return found
        return None

    for gate in gates:
        # Skipping SubPlans (run per row of the node that reads them), the innermost plan
        # around the gate must be an InitPlan: run once, when its value is first needed. A
        # CTE would not do: the gate could then sit in the filter of the scan it guards.
        names = [name for name in enclosing_plans(shape.root, gate) if not name.startswith("SubPlan")]
        assert names and names[-1].startswith("InitPlan"), f"the gate is not a one-time InitPlan (in {names})"
    lockers = [node for node in _nodes(shape.root) if node["Node Type"] in LOCKING_NODES]
    assert lockers, "the plan locks no row"
    for node in lockers:
        sources = _row_sources(node)
        assert sources and all(shape.gated(source) for source in sources), (
            " ".join(filter(None, [node["Node Type"], node.get("Operation"), node.get("Relation Name")]))
            + " can receive rows before the fair gate has run"
        )


def assert_indexes(plan: list, expected: tuple[str, ...]) -> None:
    used = {node["Index Name"] for node in _nodes(plan[0]["Plan"]) if "Index Name" in node}
    missing = set(expected) - used
    assert not missing, f"index(es) {sorted(missing)} not used; the plan uses {sorted(used)}"


@pytest.mark.parametrize("generic", [False, True], ids=["custom plan", "generic plan"])
@pytest.mark.parametrize("name", list(CASES))
def test_gate_runs_before_any_row_lock_and_the_expected_index_is_used(world, name, generic):
    case = CASES[name]
    plan = explain_call(lambda: case.call(world), case.matches, generic=generic)
    try:
        assert_gate_first(plan)
        assert_indexes(plan, case.indexes)
    except AssertionError as error:
        raise AssertionError(f"{name}, {'generic' if generic else 'custom'} plan: {error}\n{_outline(plan)}") from None


def _outline(plan: list) -> str:
    """The plan as indented node lines, for a failure message."""
    lines = []

    def walk(node, depth):
        label = node["Node Type"]
        for key in ("Subplan Name", "Relation Name", "Index Name", "CTE Name", "One-Time Filter"):
            if key in node:
                label += f" [{key}: {node[key]}]"
        if _computes_gate(node):
            label += " <- the gate"
        lines.append("  " * depth + label)
        for child in node.get("Plans", []):
            walk(child, depth + 1)

    walk(plan[0]["Plan"], 0)
    return "\n".join(lines)
