"""A ledger of what a test did to runstate, and a checker that holds the database to it.

A test records every operation it performs (through the service layer, HTTP or the SDK,
in this process or in child processes) with what it was told: ``ok`` (and the ids or state
returned), ``refused`` (a domain error code: the server answered and said no) or ``unknown``
(no answer: a transport error, a killed process; the operation may or may not have
committed, so no check relies on it). Afterwards ``Ledger.check(project_id)`` reads the
database and returns a ``Report``; ``assert_clean`` raises with every violation spelled out.

Recording::

    ledger = Ledger()                                     # thread-safe
    ledger.record("complete", claim_id=cid, ok=True, state="SUCCEEDED", outcome={"i": 1})
    ledger.record("complete", claim_id=cid, code="LEASE_LOST")        # refused
    with ledger.op("claim", run_id=run.id) as call:       # service layer or SDK
        claims = task_claim(...)
        call.done(claim_ids=[c.claim_id for c in claims])
    ledger.record_response("submit", response, run_id=run.id, task_id=...)   # DRF / httpx
    watch_sdk(rs)      # SDK calls recorded with ledger.op then note the SDK's own retries
    Ledger(path="ledger.jsonl")    # also appends each entry as a JSON line (child processes)
    ledger.merge(Ledger.load(path))                       # read a child's entries back

Operations (``op``) and their fields: ``submit`` (run_id, task_id), ``claim`` (run_id,
claim_ids), ``renew`` / ``complete`` / ``fail`` / ``release`` (claim_id; complete: outcome,
state; fail: error, retry, state), ``cancel_task`` (task_id), ``cancel_run`` /
``complete_run`` (run_id), ``verdict`` (group_id, task_id, verdict, group_state, outcome),
``group_decision`` (group_id, outcome, reason: what a wait, close or status showed), and
``effect`` (task_id, attempt: a handler did its side effect once under that claim).

What ``check`` holds the database to (each check's name is in the report):

- ``claimed_once``: no claim id (task, attempt) was handed out twice, by the ledger's ok
  claims or by the ``task.claimed`` events.
- ``finished_once``: a task reaches a terminal state once: at most one acknowledged
  ``complete`` / final ``fail`` per task in the ledger, and in the events at most one
  terminal event per task and none after it.
- ``event_replay``: a task's events, replayed in id order as the state machine (submitted,
  claimed with attempt n+1 from QUEUED, requeued, succeeded with the current attempt, ...),
  are legal and end in the state and attempt count the task row shows.
- ``acknowledged``: nothing acknowledged is lost: every ok submit exists; every ok
  complete / final fail is what the database shows for that task and attempt (state,
  outcome, error); every ok retrying fail left its ``task.requeued`` event; every ok verdict
  is the member's verdict.
- ``refused_not_recorded``: a complete or fail that was refused (and never also acknowledged
  or left unknown for the same claim) is not what the database shows for that attempt. The
  SDK retries idempotent calls by itself, and the retry of a request that committed answers
  ``LEASE_LOST``: record SDK calls on a client passed to ``watch_sdk`` (or built with
  ``max_retries=0``), so such a refusal counts as unknown.
- ``fenced``: an acknowledged renew, complete or fail of attempt ``a`` never started after
  the ledger saw attempt ``b > a`` of the same task claimed, nor after a cancel or complete
  of the task's run (or an ancestor) was acknowledged; no submit or claim was acknowledged
  under a run after such an acknowledged end. Times are ``time.monotonic_ns()``, one clock
  for every process of the machine.
- ``no_work_after_end``: nothing is accepted under a run once its cancel (or complete, or
  deadline sweep) committed. See "Why event ids order these" below.
- ``decided_once``: at most one ``group.finalized`` event per group; a finalized group has
  exactly one and its outcome and reason are the row's; every decision the test saw (waits,
  closes, verdict answers) is that one.
- ``effects_once``: a handler ran its side effect at most once per claim, and a succeeded
  task whose effects are tracked did it under the succeeding claim.
- ``drained`` (only when asked, ``drained_runs=``): every task of those runs' subtrees is
  terminal (no queued task lost) and no task anywhere in the project is held on a lease that
  expired more than ``stuck_after_s`` ago.

Why event ids order these (PostgreSQL; see ``coordination/services/locking.py`` and
``docs/internals.md``): event ids come from one sequence, and ``nextval`` is monotonic across
sessions as long as the sequence caches one value (checked here, ``sequence_cache``). Two
transactions that hold conflicting row locks while inserting their events are serialized:
the second acquires the lock after the first committed, so its event ids are larger. Hence

- the events of one task are in commit order by id: every writer of a task event holds the
  task row ``FOR UPDATE`` (claims, claim operations, sweeps, cascades) or inserts the row;
- a creator of new work under a run (submit, claim, child run, group, barrier arrival)
  holds ``FOR KEY SHARE`` on every run of its chain while writing its event, and a cancel,
  complete or deadline sweep holds ``FOR UPDATE`` on the run while writing ``run.cancelled``
  / ``run.completed`` / ``run.deadline_exceeded``: an acceptance event of the subtree with a
  larger id, from another transaction (another ``txid``), was written after the end
  committed, and is a violation;
- a complete or fail does not lock the run chain but locks the task row, which the end's
  cascade also locks ``FOR UPDATE``: a ``task.succeeded`` / ``task.failed`` /
  ``task.requeued`` of the subtree with a larger id than the end event from another
  transaction is a violation too.

Timestamps (``finished_at``, ``ended_at``) are taken before locks are acquired, so they do
not order commits and are not used. A buggy acceptance that raced the end *and* allocated
its event id before the end event cannot be ordered this way; it shows instead as work left
unfinished under an ended run (also checked: the cascade must have ended every unfinished
task of the subtree) or as an acknowledged outcome the database does not show. On SQLite
writers are serialized, so id order is commit order outright; ``txid`` is 0 there and the
end's own later events are group-member cancellations, which are not acceptance events.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

OK, REFUSED, UNKNOWN = "ok", "refused", "unknown"
TERMINAL_EVENTS = ("task.succeeded", "task.failed", "task.cancelled", "task.expired")
# Events that accept new work under a run (written holding FOR KEY SHARE on the run chain).
ACCEPTANCE_EVENTS = (
    "task.submitted",
    "task.claimed",
    "run.created",
    "group.created",
    "barrier.arrived",
)
# Events of a claim's outcome (written holding the task row, which the cascade locks too).
OUTCOME_EVENTS = ("task.succeeded", "task.failed", "task.requeued")
END_EVENTS = ("run.cancelled", "run.completed", "run.deadline_exceeded")


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def parse_claim(claim_id: str) -> tuple[str, int]:
    """Return ``(task id, attempt)`` of a claim id ``c_<task hex>_<attempt>``."""
    _, task_hex, attempt = str(claim_id).split("_")
    return str(uuid.UUID(hex=task_hex)), int(attempt)


def error_code(error: BaseException) -> str | None:
    """Return the domain code of a refusal, or None when no answer came (outcome unknown).

    Service errors (``CoordinationError``) and SDK errors with an HTTP status are refusals;
    SDK transport errors and anything else are unknown.
    """
    from coordination.domain.exceptions import CoordinationError

    if isinstance(error, CoordinationError):
        return error.code
    try:
        from runstate import RunstateError
    except ImportError:  # pragma: no cover - the SDK is part of the repo
        return None
    if isinstance(error, RunstateError) and error.status_code is not None and error.status_code < 500:
        return error.code
    return None


# The HTTP requests sent by the SDK call a ``Ledger.op`` block is running (see ``watch_sdk``).
_http_requests: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("ledger_http_requests", default=None)


def watch_sdk(client) -> None:
    """Count the HTTP requests behind each SDK call recorded with ``Ledger.op`` on ``client``.

    The SDK retries idempotent calls (complete, fail, renew...) on transport errors and
    502/503/504/429 by itself. A retry of a request that had committed answers
    ``LEASE_LOST``: that refusal is then no proof the first request did nothing, so an
    operation that took more than one request is recorded with ``http_requests`` and never
    held to ``refused_not_recorded``. Works with ``Runstate`` and ``AsyncRunstate``; the
    other way is a client with ``max_retries=0``.
    """
    watch_http(client._http._client)


def watch_http(http) -> None:
    """Count the requests ``http`` (an ``httpx.Client`` or ``AsyncClient``) sends within ``counting_requests``."""

    def count(request) -> None:
        requests = _http_requests.get()
        if requests is not None:
            requests[0] += 1

    async def count_async(request) -> None:
        count(request)

    import httpx

    hook = count_async if isinstance(http, httpx.AsyncClient) else count
    http.event_hooks = {**http.event_hooks, "request": [*http.event_hooks.get("request", []), hook]}


@contextlib.contextmanager
def counting_requests() -> Iterator[list[int]]:
    """Count, in the yielded list's one item, the requests watched clients send within the block."""
    requests = [0]
    token = _http_requests.set(requests)
    try:
        yield requests
    finally:
        _http_requests.reset(token)


@dataclass
class Entry:
    """One operation and what the caller was told."""

    op: str
    result: str  # ok | refused | unknown
    code: str | None = None
    started_ns: int = 0
    ended_ns: int = 0
    run_id: str | None = None
    task_id: str | None = None
    claim_id: str | None = None
    group_id: str | None = None
    claim_ids: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.result == OK

    @property
    def claim(self) -> tuple[str, int] | None:
        return parse_claim(self.claim_id) if self.claim_id else None

    def describe(self) -> str:
        ids = self.claim_id or self.task_id or self.group_id or self.run_id or ",".join(self.claim_ids)
        told = self.result if self.code is None else f"{self.result} {self.code}"
        return f"{self.op} {ids} -> {told}" + (f" ({self.source})" if self.source else "")


class Call:
    """An operation in progress, from ``Ledger.op``: add what it returned with ``done``."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def done(self, **fields: Any) -> None:
        """Add what the operation returned (``task_id=``, ``claim_ids=``, ``state=``...)."""
        self.fields.update(fields)


_ENTRY_FIELDS = {"run_id", "task_id", "claim_id", "group_id", "claim_ids"}


class Ledger:
    """Every operation a test performed and its result; thread-safe, optionally mirrored to a file."""

    def __init__(self, path: str | os.PathLike | None = None, *, source: str = "") -> None:
        self._lock = threading.Lock()
        self.entries: list[Entry] = []
        self.path = Path(path) if path is not None else None
        self.source = source

    # Recording -------------------------------------------------------------------------

    def record(
        self,
        op: str,
        *,
        ok: bool | None = None,
        code: str | None = None,
        unknown: bool = False,
        started_ns: int | None = None,
        **fields: Any,
    ) -> Entry:
        """Record one operation: ``ok=True``, a refusal ``code``, or ``unknown=True``.

        Fields named ``run_id``, ``task_id``, ``claim_id``, ``group_id`` and ``claim_ids``
        identify what it touched; any other keyword (``state``, ``outcome``, ``error``,
        ``retry``, ``verdict``, ``attempt``...) is kept in ``data``.
        """
        if unknown:
            result = UNKNOWN
        elif code is not None:
            result = REFUSED
        elif ok:
            result = OK
        else:
            raise ValueError("record needs ok=True, a refusal code or unknown=True")
        now = time.monotonic_ns()
        entry = Entry(op=op, result=result, code=code, started_ns=started_ns or now, ended_ns=now)
        entry.source = fields.pop("source", self.source)
        for name, value in fields.items():
            if name == "claim_ids":
                entry.claim_ids = [str(c) for c in value]
            elif name in _ENTRY_FIELDS:
                setattr(entry, name, _str(value))
            else:
                entry.data[name] = _jsonable(value)
        if entry.claim_id and entry.task_id is None:
            entry.task_id = parse_claim(entry.claim_id)[0]
        self._append(entry)
        return entry

    @contextlib.contextmanager
    def op(self, op: str, **fields: Any) -> Iterator[Call]:
        """Record the operation run in the ``with`` block: ok, refused (re-raised) or unknown (re-raised)."""
        call = Call(dict(fields))
        started = time.monotonic_ns()
        try:
            with counting_requests() as requests:
                yield call
        except BaseException as error:
            if requests[0] > 1:
                call.fields["http_requests"] = requests[0]
            code = error_code(error) if isinstance(error, Exception) else None
            if code is not None:
                self.record(op, code=code, started_ns=started, **call.fields)
            else:
                self.record(op, unknown=True, started_ns=started, error_type=type(error).__name__, **call.fields)
            raise
        if requests[0] > 1:
            call.fields["http_requests"] = requests[0]
        self.record(op, ok=True, started_ns=started, **call.fields)

    def record_response(self, op: str, response, *, started_ns: int | None = None, **fields: Any) -> Entry:
        """Record an HTTP answer (DRF test client or httpx): 2xx ok, 4xx refused with its code, else unknown."""
        status = response.status_code
        if 200 <= status < 300:
            return self.record(op, ok=True, started_ns=started_ns, **fields)
        if 400 <= status < 500:
            try:
                code = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = f"HTTP_{status}"
            return self.record(op, code=code, started_ns=started_ns, **fields)
        return self.record(op, unknown=True, started_ns=started_ns, status=status, **fields)

    def _append(self, entry: Entry) -> None:
        line = json.dumps(asdict(entry)) + "\n" if self.path is not None else None
        with self._lock:
            self.entries.append(entry)
            if line is not None:
                # One write of a short line with O_APPEND: whole lines, even from many processes.
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)

    @classmethod
    def load(cls, *paths: str | os.PathLike) -> Ledger:
        """Read the entries other processes appended; a line cut short by SIGKILL is skipped."""
        ledger = cls()
        for path in paths:
            with contextlib.suppress(FileNotFoundError), open(path) as handle:
                for line in handle:
                    try:
                        ledger.entries.append(Entry(**json.loads(line)))
                    except (ValueError, TypeError):
                        continue
        return ledger

    def merge(self, *others: Ledger) -> Ledger:
        """Add the entries of ``others`` (e.g. loaded from child processes); return self."""
        with self._lock:
            for other in others:
                self.entries.extend(other.entries)
        return self

    def snapshot(self) -> list[Entry]:
        with self._lock:
            return list(self.entries)

    # Checking --------------------------------------------------------------------------

    def check(
        self,
        project_id,
        *,
        drained_runs: Iterable[Any] = (),
        stuck_after_s: float = 5.0,
    ) -> Report:
        """Read the database of ``project_id`` and hold it to this ledger; return the report."""
        return _Checker(self.snapshot(), project_id, drained_runs=drained_runs, stuck_after_s=stuck_after_s).run()

    def assert_clean(self, project_id, **kwargs: Any) -> Report:
        """Check, and raise ``AssertionError`` listing every violation if there is any; return the report."""
        report = self.check(project_id, **kwargs)
        if report.violations:
            raise AssertionError(report.describe())
        return report


# Ledgers of child processes ----------------------------------------------------------------

# The directory where worker processes started by a test write their ledgers.
LEDGER_DIR_ENV = "RUNSTATE_FAULT_LEDGER_DIR"
_process_ledgers: dict[tuple[str, int], Ledger] = {}
_process_ledgers_lock = threading.Lock()


def process_ledger(kind: str) -> Ledger:
    """Return this process's ledger: its entries go to ``<kind>-<pid>.jsonl`` in ``LEDGER_DIR_ENV``'s directory.

    Without the variable the entries stay in memory. A forked child gets a ledger of its own.
    """
    key = (kind, os.getpid())
    with _process_ledgers_lock:
        if key not in _process_ledgers:
            directory = os.environ.get(LEDGER_DIR_ENV)
            path = Path(directory) / f"{kind}-{os.getpid()}.jsonl" if directory else None
            _process_ledgers[key] = Ledger(path, source=f"{kind}/{os.getpid()}")
        return _process_ledgers[key]


# Checking in a process of its own ------------------------------------------------------

_CHECK_SCRIPT = """
import sys
import django
django.setup()
from tests.reliability.ledger import Ledger
project_id, drained, *paths = sys.argv[1:]
report = Ledger.load(*paths).assert_clean(project_id, drained_runs=[run for run in drained.split(",") if run])
print(report.describe())
"""


def check_in_process(env: dict[str, str], project_id: str, *paths: str | os.PathLike, drained_runs=()) -> str:
    """Hold the database ``env`` names to the ledgers at ``paths`` in a child process; return the counts line.

    For the tests that run runstate on servers of their own (a throwaway cluster, a standby
    pair): this process's Django is set up for the suite's database, the child's for
    ``env``'s ``DATABASE_URL``. Raise ``AssertionError`` with every violation.
    """
    checked = subprocess.run(
        [sys.executable, "-c", _CHECK_SCRIPT, str(project_id), ",".join(map(str, drained_runs)), *map(str, paths)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, f"{checked.stdout}\n{checked.stderr[-6000:]}"
    return checked.stdout.strip().splitlines()[-1].strip()


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


@dataclass(frozen=True)
class Violation:
    check: str
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.subject}: {self.detail}"


@dataclass
class Report:
    """What was checked (``counts``) and what was wrong (``violations``)."""

    counts: Counter = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations

    def checks_failed(self) -> set[str]:
        return {v.check for v in self.violations}

    def describe(self, limit: int = 50) -> str:
        lines = [f"ledger check: {len(self.violations)} violation(s)"]
        lines += [f"  {v}" for v in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"  ... and {len(self.violations) - limit} more")
        lines.append("  counts: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())))
        return "\n".join(lines)


class _Checker:
    def __init__(self, entries: list[Entry], project_id, *, drained_runs, stuck_after_s: float) -> None:
        self.entries = entries
        self.project_id = project_id
        self.drained_runs = [str(r) for r in drained_runs]
        self.stuck_after_s = stuck_after_s
        self.report = Report()

    def flag(self, check: str, subject: object, detail: str) -> None:
        self.report.violations.append(Violation(check, str(subject), detail))

    def run(self) -> Report:
        from django.db import connection

        from coordination.models import Event, GroupMember, Run, Task, TaskGroup

        pid = self.project_id
        self.tasks = {
            str(t["id"]): t
            for t in Task.objects.filter(project_id=pid).values(
                "id", "state", "attempts", "outcome", "error", "run_id", "run_path", "lease_expires_at"
            )
        }
        self.runs = {str(r["id"]): r for r in Run.objects.filter(project_id=pid).values()}
        self.groups = {str(g["id"]): g for g in TaskGroup.objects.filter(project_id=pid).values()}
        self.verdicts = {
            (str(g), str(t)): v
            for g, t, v in GroupMember.objects.filter(group__project_id=pid).values_list(
                "group_id", "task_id", "verdict"
            )
        }
        self.events = list(
            Event.objects.filter(project_id=pid)
            .order_by("id")
            .values("id", "txid", "type", "run_path", "subject_id", "data")
        )
        self.vendor = connection.vendor
        self.task_events: dict[str, list[dict]] = defaultdict(list)
        for event in self.events:
            if event["type"].startswith("task."):
                self.task_events[event["subject_id"]].append(event)
        counts = self.report.counts
        counts["ledger_entries"] = len(self.entries)
        for entry in self.entries:
            counts[f"{entry.op}_{entry.result}"] += 1
        counts["tasks"] = len(self.tasks)
        for task in self.tasks.values():
            counts[f"tasks_{task['state']}"] += 1
        counts["events"] = len(self.events)
        counts["takeovers"] = sum(
            1 for e in self.events if e["type"] == "task.requeued" and e["data"].get("cause") == "lease_expired"
        )
        counts["reclaims"] = sum(
            1 for e in self.events if e["type"] == "task.claimed" and e["data"].get("attempt", 1) > 1
        )
        self.sequence_cache()
        self.claimed_once()
        self.finished_once()
        self.event_replay()
        self.acknowledged()
        self.refused_not_recorded()
        self.fenced()
        self.no_work_after_end()
        self.decided_once()
        self.effects_once()
        if self.drained_runs:
            self.drained()
        return self.report

    # Individual checks -----------------------------------------------------------------

    def sequence_cache(self) -> None:
        """The id-order arguments need a sequence that hands out one value at a time."""
        if self.vendor != "postgresql":
            return
        from django.db import connection

        from coordination.models import Event

        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT seqcache FROM pg_sequence WHERE seqrelid = pg_get_serial_sequence(%s, 'id')::regclass",
                [Event._meta.db_table],
            )
            row = cursor.fetchone()
        if row is not None and row[0] != 1:
            self.flag("sequence_cache", Event._meta.db_table, f"cache {row[0]}: event ids do not order commits")

    def claimed_once(self) -> None:
        seen: Counter = Counter(c for e in self.entries if e.op == "claim" and e.ok for c in e.claim_ids)
        for claim_id, times in seen.items():
            if times > 1:
                self.flag("claimed_once", claim_id, f"handed out {times} times (ledger)")
        claimed: Counter = Counter(
            (e["subject_id"], e["data"].get("attempt")) for e in self.events if e["type"] == "task.claimed"
        )
        for (task_id, attempt), times in claimed.items():
            if times > 1:
                self.flag("claimed_once", task_id, f"attempt {attempt} claimed {times} times (events)")
        self.report.counts["claims_handed_out"] = len(claimed)

    def _final(self, entry: Entry) -> bool | None:
        """Whether an ok complete / fail entry ended its task; None when unknown (a retrying fail, no state told)."""
        if entry.op == "complete":
            return True
        if entry.op != "fail":
            return False
        if "state" in entry.data:
            return entry.data["state"] != "QUEUED"
        return None if entry.data.get("retry") else True

    def finished_once(self) -> None:
        finishes: dict[str, list[Entry]] = defaultdict(list)
        for entry in self.entries:
            if entry.op in ("complete", "fail") and entry.ok and self._final(entry):
                finishes[entry.task_id].append(entry)
        for task_id, entries in finishes.items():
            if len(entries) > 1:
                told = "; ".join(e.describe() for e in entries)
                self.flag("finished_once", task_id, f"{len(entries)} acknowledged finishes: {told}")
        for task_id, events in self.task_events.items():
            terminal = [e for e in events if e["type"] in TERMINAL_EVENTS]
            if len(terminal) > 1:
                types = ", ".join(f"{e['type']}#{e['id']}" for e in terminal)
                self.flag("finished_once", task_id, f"reached a terminal state {len(terminal)} times: {types}")

    def event_replay(self) -> None:
        for task_id, task in self.tasks.items():
            state, attempts = None, 0
            for event in self.task_events.get(task_id, []):
                kind, data = event["type"], event["data"]
                problem = None
                if state in ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED"):
                    problem = f"{kind} after {state}"
                elif kind == "task.submitted":
                    problem = None if state is None else f"submitted again in {state}"
                    state = "QUEUED"
                elif kind == "task.claimed":
                    if state != "QUEUED":
                        problem = f"claimed in {state}"
                    elif data.get("attempt") != attempts + 1:
                        problem = f"claimed attempt {data.get('attempt')} after {attempts}"
                    attempts = data.get("attempt", attempts + 1)
                    state = "RUNNING"
                elif kind == "task.requeued":
                    problem = None if state in ("RUNNING", "CANCELLATION_REQUESTED") else f"requeued in {state}"
                    state = "QUEUED"
                elif kind == "task.cancellation_requested":
                    problem = None if state == "RUNNING" else f"cancellation requested in {state}"
                    state = "CANCELLATION_REQUESTED"
                elif kind == "task.succeeded":
                    if state != "RUNNING":
                        problem = f"succeeded in {state}"
                    elif data.get("attempt", attempts) != attempts:
                        problem = f"succeeded by attempt {data.get('attempt')} while attempt {attempts} held it"
                    state = "SUCCEEDED"
                elif kind == "task.failed":
                    if state not in ("RUNNING", "CANCELLATION_REQUESTED"):
                        problem = f"failed in {state}"
                    elif data.get("attempt", attempts) != attempts:
                        problem = f"failed by attempt {data.get('attempt')} while attempt {attempts} held it"
                    state = "FAILED"
                elif kind in ("task.cancelled", "task.expired"):
                    state = "CANCELLED" if kind == "task.cancelled" else "EXPIRED"
                if problem:
                    self.flag("event_replay", task_id, f"event #{event['id']}: {problem}")
            if state is None:
                self.flag("event_replay", task_id, "task has no task.submitted event")
            elif (state, attempts) != (task["state"], task["attempts"]):
                self.flag(
                    "event_replay",
                    task_id,
                    f"events end in {state} after {attempts} attempt(s); the row says {task['state']} "
                    f"after {task['attempts']}",
                )

    def _terminal_event(self, task_id: str) -> dict | None:
        return next((e for e in self.task_events.get(task_id, []) if e["type"] in TERMINAL_EVENTS), None)

    def acknowledged(self) -> None:
        for entry in self.entries:
            if not entry.ok:
                continue
            if entry.op == "submit":
                ids = [entry.task_id] if entry.task_id else entry.data.get("task_ids", [])
                for task_id in ids:
                    if task_id not in self.tasks:
                        self.flag("acknowledged", task_id, "submit acknowledged, no such task in the database")
                    elif not any(e["type"] == "task.submitted" for e in self.task_events.get(task_id, [])):
                        self.flag("acknowledged", task_id, "submit acknowledged, no task.submitted event")
            elif entry.op in ("complete", "fail"):
                self._acknowledged_outcome(entry)
            elif entry.op == "verdict":
                actual = self.verdicts.get((entry.group_id, entry.task_id))
                if actual != entry.data.get("verdict"):
                    self.flag(
                        "acknowledged",
                        entry.task_id,
                        f"verdict {entry.data.get('verdict')} acknowledged, row says {actual}",
                    )

    def _acknowledged_outcome(self, entry: Entry) -> None:
        task_id, attempt = entry.claim
        task = self.tasks.get(task_id)
        if task is None:
            self.flag("acknowledged", entry.claim_id, f"{entry.op} acknowledged on a task that does not exist")
            return
        final = self._final(entry)
        if entry.op == "fail" and not final:
            requeued = any(
                e["type"] == "task.requeued" and e["data"].get("attempt") == attempt
                for e in self.task_events.get(task_id, [])
            )
            # Told no state, a retrying fail may also have been the last attempt's.
            failed = final is None and task["state"] == "FAILED" and task["attempts"] == attempt
            if not (requeued or failed):
                self.flag("acknowledged", entry.claim_id, "retrying fail acknowledged, no task.requeued event for it")
            return
        expected = entry.data.get("state") or ("SUCCEEDED" if entry.op == "complete" else "FAILED")
        terminal = self._terminal_event(task_id)
        problems = []
        if task["state"] != expected:
            problems.append(f"state {task['state']} (acknowledged {expected})")
        if task["attempts"] != attempt:
            problems.append(f"attempts {task['attempts']} (acknowledged attempt {attempt})")
        if terminal is not None and terminal["data"].get("attempt", attempt) != attempt:
            problems.append(f"{terminal['type']} event of attempt {terminal['data'].get('attempt')}")
        if entry.op == "complete" and "outcome" in entry.data and task["outcome"] != entry.data["outcome"]:
            problems.append(f"outcome {task['outcome']!r} (acknowledged {entry.data['outcome']!r})")
        if entry.op == "fail" and "error" in entry.data and task["error"] != entry.data["error"]:
            problems.append(f"error {task['error']!r} (acknowledged {entry.data['error']!r})")
        if problems:
            self.flag("acknowledged", entry.claim_id, f"{entry.op} acknowledged, but " + "; ".join(problems))

    def refused_not_recorded(self) -> None:
        told: dict[str, set[str]] = defaultdict(set)
        for entry in self.entries:
            if entry.op in ("complete", "fail") and entry.claim_id:
                # A refusal of a retry may answer a request that had committed: not a refusal.
                retried = entry.result == REFUSED and entry.data.get("http_requests", 1) > 1
                told[entry.claim_id].add(UNKNOWN if retried else entry.result)
        for claim_id, results in told.items():
            if results != {REFUSED}:
                continue  # acknowledged, or an unknown answer that may have committed
            task_id, attempt = parse_claim(claim_id)
            # Outcome events a claim writes carry its attempt (a lease-expiry failure does not).
            for event in self.task_events.get(task_id, []):
                if event["type"] == "task.requeued" and event["data"].get("cause") != "retry":
                    continue
                if event["type"] in OUTCOME_EVENTS and event["data"].get("attempt") == attempt:
                    self.flag(
                        "refused_not_recorded",
                        claim_id,
                        f"every complete/fail of this claim was refused, yet {event['type']} #{event['id']} "
                        f"records attempt {attempt}",
                    )

    def _run_path(self, entry: Entry) -> str | None:
        if entry.task_id and entry.task_id in self.tasks:
            return self.tasks[entry.task_id]["run_path"]
        if entry.run_id and entry.run_id in self.runs:
            return self.runs[entry.run_id]["path"]
        return None

    def fenced(self) -> None:
        # Attempts the ledger saw handed out, with when the claim was acknowledged.
        claimed_at: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for entry in self.entries:
            if entry.op == "claim" and entry.ok:
                for claim_id in entry.claim_ids:
                    task_id, attempt = parse_claim(claim_id)
                    claimed_at[task_id].append((attempt, entry.ended_ns))
        ends = [
            (self.runs[e.run_id]["path"], e)
            for e in self.entries
            if e.op in ("cancel_run", "complete_run") and e.ok and e.run_id in self.runs
        ]
        for entry in self.entries:
            if not entry.ok:
                continue
            if entry.op in ("renew", "complete", "fail"):
                task_id, attempt = entry.claim
                for later, acked_ns in claimed_at.get(task_id, []):
                    if later > attempt and acked_ns < entry.started_ns:
                        self.flag(
                            "fenced",
                            entry.claim_id,
                            f"{entry.op} acknowledged though attempt {later} had been claimed before it started",
                        )
            if entry.op not in ("submit", "claim", "renew", "complete", "fail"):
                continue
            path = self._run_path(entry)
            if path is None:
                continue
            for end_path, end in ends:
                if path.startswith(end_path) and end.ended_ns < entry.started_ns:
                    self.flag(
                        "fenced",
                        entry.claim_id or entry.task_id or entry.run_id,
                        f"{entry.op} acknowledged though {end.op} of run {end.run_id} "
                        "was acknowledged before it started",
                    )

    def no_work_after_end(self) -> None:
        ends = [e for e in self.events if e["type"] in END_EVENTS]
        counts = self.report.counts
        counts["run_ends"] = len(ends)
        for end in ends:
            prefix = end["run_path"]
            for event in self.events:
                if event["id"] <= end["id"] or not event["run_path"].startswith(prefix):
                    continue
                if self.vendor == "postgresql" and event["txid"] == end["txid"]:
                    continue  # the end's own transaction (a group finalizing as its member completes)
                if event["type"] in ACCEPTANCE_EVENTS or event["type"] in OUTCOME_EVENTS:
                    self.flag(
                        "no_work_after_end",
                        event["subject_id"],
                        f"{event['type']} #{event['id']} committed after {end['type']} #{end['id']} "
                        f"of run {end['subject_id']}",
                    )
        ended_paths = [
            r["path"]
            for r in self.runs.values()
            if r["stored_state"] in ("CANCELLED", "COMPLETED") or r["deadline_swept_at"] is not None
        ]
        for task_id, task in self.tasks.items():
            if task["state"] in ("QUEUED", "RUNNING", "CANCELLATION_REQUESTED") and any(
                task["run_path"].startswith(p) for p in ended_paths
            ):
                self.flag("no_work_after_end", task_id, f"{task['state']} under an ended run")

    def decided_once(self) -> None:
        decisions: dict[str, list[dict]] = defaultdict(list)
        for event in self.events:
            if event["type"] == "group.finalized":
                decisions[event["subject_id"]].append(event)
        for group_id, group in self.groups.items():
            found = decisions.get(group_id, [])
            if len(found) > 1:
                self.flag("decided_once", group_id, f"{len(found)} group.finalized events")
            if group["state"] == "FINALIZED" and not found:
                self.flag("decided_once", group_id, "finalized without a group.finalized event")
            if group["state"] != "FINALIZED" and found:
                self.flag("decided_once", group_id, f"{group['state']} but a group.finalized event exists")
            for event in found:
                told = (event["data"].get("outcome"), event["data"].get("reason"))
                if told != (group["outcome"], group["outcome_reason"]):
                    self.flag(
                        "decided_once",
                        group_id,
                        f"event #{event['id']} says {told}, row says {(group['outcome'], group['outcome_reason'])}",
                    )
        self.report.counts["groups_decided"] = len(decisions)
        for entry in self.entries:
            if not entry.ok or entry.op not in ("group_decision", "verdict"):
                continue
            outcome = entry.data.get("outcome")
            if outcome is None:
                continue
            group = self.groups.get(entry.group_id)
            if group is None:
                self.flag("decided_once", entry.group_id, f"{entry.op} saw a decision of a group that does not exist")
                continue
            seen = (outcome, entry.data.get("reason", group["outcome_reason"]))
            if seen != (group["outcome"], group["outcome_reason"]):
                self.flag(
                    "decided_once",
                    entry.group_id,
                    f"{entry.op} saw {seen}, the row says {(group['outcome'], group['outcome_reason'])}",
                )

    def effects_once(self) -> None:
        effects: Counter = Counter(
            (e.task_id, int(e.data.get("attempt", 0))) for e in self.entries if e.op == "effect" and e.ok
        )
        self.report.counts["effects"] = sum(effects.values())
        for (task_id, attempt), times in effects.items():
            if times > 1:
                self.flag("effects_once", task_id, f"the handler ran {times} times under attempt {attempt}")
        tracked = {task_id for task_id, _ in effects}
        for task_id in tracked:
            task = self.tasks.get(task_id)
            if task is not None and task["state"] == "SUCCEEDED" and (task_id, task["attempts"]) not in effects:
                self.flag("effects_once", task_id, f"succeeded by attempt {task['attempts']}, which did no side effect")

    def drained(self) -> None:
        from django.utils import timezone

        paths = [self.runs[r]["path"] for r in self.drained_runs if r in self.runs]
        for run_id in self.drained_runs:
            if run_id not in self.runs:
                self.flag("drained", run_id, "no such run in the project")
        stuck_before = timezone.now() - timedelta(seconds=self.stuck_after_s)
        for task_id, task in self.tasks.items():
            held = task["state"] in ("RUNNING", "CANCELLATION_REQUESTED")
            if held and task["lease_expires_at"] is not None and task["lease_expires_at"] < stuck_before:
                self.flag(
                    "drained", task_id, f"stuck in {task['state']} on a lease that expired {task['lease_expires_at']}"
                )
            elif task["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED") and any(
                task["run_path"].startswith(p) for p in paths
            ):
                self.flag("drained", task_id, f"still {task['state']} after the run was drained")


class Services:
    """The service layer, each call recorded in a ledger (refusals are recorded and re-raised).

    ``ops = Services(ledger, project_id)``; ``ops.submit(mailbox, run_id, {...})``,
    ``ops.claim(mailbox, run_id)``, ``ops.complete(claim_id, outcome)``...
    """

    def __init__(self, ledger: Ledger, project_id) -> None:
        self.ledger = ledger
        self.project_id = project_id

    def submit(self, mailbox, run_id, input: Any, **kwargs: Any):
        from coordination.services.tasks import task_submit

        with self.ledger.op("submit", run_id=run_id) as call:
            task, _ = task_submit(project_id=self.project_id, mailbox=mailbox, run_id=run_id, input=input, **kwargs)
            call.done(task_id=task.id)
        return task

    def claim(self, mailbox, run_id, *, max_claims: int = 1, **kwargs: Any):
        from coordination.services.claims import task_claim

        with self.ledger.op("claim", run_id=run_id) as call:
            claims = task_claim(
                project_id=self.project_id, mailbox=mailbox, run_id=run_id, max_claims=max_claims, **kwargs
            )
            call.done(claim_ids=[c.claim_id for c in claims])
        return claims

    def renew(self, claim_id: str, **kwargs: Any):
        from coordination.services.claims import claim_renew

        with self.ledger.op("renew", claim_id=claim_id) as call:
            claim = claim_renew(project_id=self.project_id, claim_id=claim_id, **kwargs)
            call.done(state=claim.task.state)
        return claim

    def complete(self, claim_id: str, outcome: Any = None):
        from coordination.services.claims import claim_complete

        with self.ledger.op("complete", claim_id=claim_id, outcome=outcome) as call:
            task = claim_complete(project_id=self.project_id, claim_id=claim_id, outcome=outcome)
            call.done(state=task.state)
        return task

    def fail(self, claim_id: str, error: Any, *, retry: bool = False, retry_delay_ms: int = 0):
        from coordination.services.claims import claim_fail

        with self.ledger.op("fail", claim_id=claim_id, error=error, retry=retry) as call:
            task = claim_fail(
                project_id=self.project_id, claim_id=claim_id, error=error, retry=retry, retry_delay_ms=retry_delay_ms
            )
            call.done(state=task.state)
        return task

    def release(self, claim_id: str):
        from coordination.services.claims import claim_release

        with self.ledger.op("release", claim_id=claim_id) as call:
            task = claim_release(project_id=self.project_id, claim_id=claim_id)
            call.done(state=task.state)
        return task

    def cancel_task(self, task_id, *, reason: str | None = None, grace_ms: int | None = None):
        from coordination.services.tasks import task_cancel

        with self.ledger.op("cancel_task", task_id=task_id) as call:
            task = task_cancel(project_id=self.project_id, task_id=task_id, reason=reason, grace_ms=grace_ms)
            call.done(state=task.state)
        return task

    def cancel_run(self, run_id, *, reason: str | None = None):
        from coordination.services.runs import run_cancel

        with self.ledger.op("cancel_run", run_id=run_id):
            return run_cancel(project_id=self.project_id, run_id=run_id, reason=reason)

    def complete_run(self, run_id):
        from coordination.services.runs import run_complete

        with self.ledger.op("complete_run", run_id=run_id):
            return run_complete(project_id=self.project_id, run_id=run_id)

    def group_submit(self, group_id, input: Any, **kwargs: Any):
        from coordination.services.groups import group_submit

        with self.ledger.op("submit", group_id=group_id) as call:
            task, _, _ = group_submit(project_id=self.project_id, group_id=group_id, input=input, **kwargs)
            call.done(task_id=task.id, run_id=task.run_id)
        return task

    def verdict(self, group_id, task_id, verdict: str):
        from coordination.services.groups import group_verdict

        with self.ledger.op("verdict", group_id=group_id, task_id=task_id, verdict=verdict) as call:
            result = group_verdict(project_id=self.project_id, group_id=group_id, task_id=task_id, verdict=verdict)
            group = result.group
            if group.state == "FINALIZED":
                call.done(group_state=group.state, outcome=group.outcome, reason=group.outcome_reason)
        return result

    def close(self, group_id):
        from coordination.services.groups import group_close

        with self.ledger.op("group_decision", group_id=group_id) as call:
            group = group_close(project_id=self.project_id, group_id=group_id)
            call.done(outcome=group.outcome, reason=group.outcome_reason, group_state=group.state)
        return group
