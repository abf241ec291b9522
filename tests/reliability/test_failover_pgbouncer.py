"""A failover behind PgBouncer: the primary dies, the standby is promoted, PgBouncer is pointed at it.

The deployment ``docs/deploy.md`` gives ("PgBouncer and a standby together"): a primary with
a synchronous streaming standby (``tests/clusters.StreamingPair``), a PgBouncer in
transaction mode whose ``[databases]`` line names the primary (``server_login_retry = 1``,
``query_wait_timeout = 10``), and one uvicorn API, never restarted, with ``DATABASE_URL``
through PgBouncer (``RUNSTATE_DB_POOLER=transaction``, prepared statements off) and its
LISTEN connection straight to PostgreSQL on a multi-host URL
(``target_session_attrs=read-write``, ``connect_timeout``). PgBouncer 1.18 knows one host
per database, so what follows a promotion is the failover manager's job, done here as one
does it: write the new primary into ``pgbouncer.ini`` and ``RELOAD``.

SDK clients submit tasks with keys and claim and complete them the whole time, each call in
a ledger; one more submits tasks of a ``@runstate_task`` that a Celery worker (with beat) does
through PgBouncer too, recording its own ledger (``fault_tasks``). The primary is stopped with
``pg_ctl stop -m immediate``; 2 s later the standby is promoted, and 1 s after that PgBouncer
is pointed at it. Then:

- while there is no primary (the old one down, then the new one promoted but PgBouncer still
  sending to the old host), every request the clients sent is answered ``503
  SERVICE_UNAVAILABLE``, a submit (the hot path) and a run read (DRF) with ``Retry-After``,
  but one that PgBouncer held through its login retry until the RELOAD: that one is done on
  the new primary and answered after the RELOAD, never before;
  no answer is another 5xx, and every request sent during the whole test got an answer (no
  timeout, no reset);
- after the RELOAD the service resumes: submits and completes acknowledged within 30 s of the
  promotion (the figures are printed, ``-s``, and recorded in docs/deploy.md);
- the ledger holds against the promoted standby: every acknowledged submit and complete is
  there, nothing was completed twice; the Celery worker process started before the crash,
  never restarted, did every acknowledged task of its mailbox, those submitted after the
  switch included;
- the API's LISTEN connection is on the new primary without a restart: a long-poll and an
  event stream started after the switch are released by the complete that ends their task,
  and a key revoked through PgBouncer after the switch is refused at once by the API, which
  caches keys for an hour and forgets one only on a notification.

Durations are reported, never asserted beyond the 30 s the issue names.
"""

import json
import logging
import threading
import time
from collections import Counter

import httpx
import pytest

from runstate import Runstate, RunstateError
from tests.clusters import (
    Answers,
    ApiOnPair,
    PgBouncer,
    SdkClient,
    Submitter,
    error_code,
    refused_without_a_primary,
    require_pgbouncer,
    streaming_pair,
)
from tests.reliability.ledger import LEDGER_DIR_ENV
from tests.reliability.test_failover_workers import CELERY_MAILBOX, CELERY_MODULE, CELERY_PROJECT, HANDLER_S, prepare
from tests.reliability.test_pgbouncer import LISTEN_APP_NAME, create_key
from tests.waiting import wait_until
from tests.workers.live import TEST_BROKER_URL, beat_command, purge_broker, worker_command

pytestmark = [pytest.mark.postgres_only]

logging.getLogger("httpx").setLevel(logging.WARNING)

PROJECT = CELERY_PROJECT  # the decorated task's (tests/reliability/fault_tasks.py)
MAILBOX = "pgbouncer-failover-work"
WAIT_MAILBOX = "pgbouncer-failover-wait"  # the task the waits started after the switch wait for
SUBMITTERS = 2
CLAIMERS = 2
NO_PRIMARY_FOR_S = 2.0
RELOAD_AFTER_S = 1.0  # from the promotion to PgBouncer's RELOAD: the failover manager's reaction
RESUME_LIMIT_S = 30.0
# Every acknowledged task of the Celery mailbox is done within this of the load's end: its 2 s
# lease, the 1 s sweep, and room to spare, but less than the re-wake sweep's 60 s.
DRAIN_TIMEOUT_S = 30
# The SDK's retries wait Retry-After (1 s) at first, then its growing jittered backoff: ~30 s in all.
SDK_RETRIES = 10
# A request without an answer this long counts as unanswered (Answers): PgBouncer held it.
REQUEST_TIMEOUT_S = ApiOnPair.REQUEST_TIMEOUT_S
# Phases in which no server accepts writes through PgBouncer: every answer must be a 503.
NO_PRIMARY = ("down", "promoted")


class Claimer(SdkClient):
    """One SDK client claiming tasks of ``run_id`` and completing each, until stopped; every call in its ledger."""

    def __init__(self, api: ApiOnPair, run_id: str, answers: Answers, name: str) -> None:
        super().__init__(api, name=name, max_retries=SDK_RETRIES, timeout_s=REQUEST_TIMEOUT_S)
        self.run_id = run_id
        answers.watch(self.http)
        self.completed_at: list[float] = []

    def _run(self) -> None:
        tasks = self.rs.scope(self.run_id).tasks
        while not self.stopping.is_set():
            try:
                # Never retried by the SDK: a claim whose answer is lost is taken over after its lease.
                with self.ledger.op("claim", run_id=self.run_id) as call:
                    claims = tasks.claim(MAILBOX, max=5, wait_ms=500, worker_id=self.name)
                    call.done(claim_ids=[claim.id for claim in claims])
            except RunstateError:
                self.stopping.wait(0.2)
                continue
            for claim in claims:
                try:
                    with self.ledger.op("complete", claim_id=claim.id, outcome=self.name) as call:
                        call.done(state=claim.complete(self.name).get("state"))
                except RunstateError:
                    continue
                with self.lock:
                    self.completed_at.append(time.monotonic())

    def count(self, after: float = float("-inf")) -> int:
        with self.lock:
            return sum(1 for at in self.completed_at if at > after)

    def first(self, after: float) -> float | None:
        with self.lock:
            return min((at for at in self.completed_at if at > after), default=None)


@pytest.fixture
def behind_pgbouncer(tmp_path):
    """The pair, a PgBouncer in front of its primary, and the API through it; all stopped afterwards."""
    require_pgbouncer()
    purge_broker()
    with streaming_pair() as pair:
        # docs/deploy.md's pgbouncer.ini: a request queued in PgBouncer for a server that will not
        # come is refused after 10 s rather than PgBouncer's default 120 s.
        bouncer = PgBouncer(pair.primary, query_wait_timeout="10")
        api = None
        try:
            bouncer.start()
            api = ApiOnPair(
                pair,
                broker_url=TEST_BROKER_URL,
                log_dir=tmp_path,
                project=PROJECT,
                DATABASE_URL=bouncer.url(),
                RUNSTATE_DB_POOLER="transaction",
                RUNSTATE_DB_PREPARE_THRESHOLD="off",
                RUNSTATE_LISTEN_DATABASE_URL=pair.url(application_name=LISTEN_APP_NAME, connect_timeout="2"),
                # Keys are cached for an hour: only a notification makes the API forget one.
                RUNSTATE_PROCESS_CACHE_S="3600",
                RUNSTATE_TASK_MODULES=CELERY_MODULE,
            )
            api.start_api()
            yield api, bouncer
        finally:
            if api is not None:
                api.stop()
            bouncer.destroy()


def prepare_load(api: ApiOnPair) -> str:
    """Create the SDK clients' mailboxes and their run; return the run's id."""
    with api.client() as client:
        for mailbox in (MAILBOX, WAIT_MAILBOX):
            assert client.put(f"/v1/mailboxes/{mailbox}", json={"mode": "WORK"}).status_code in (200, 201)
        created = client.post("/v1/runs", json={"name": "pgbouncer-failover"})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def waits_are_released(api: ApiOnPair) -> dict:
    """On a new run, long-poll a new task and stream the run's events, then complete the task; return what each saw."""
    seen: dict = {}
    stream_open = threading.Event()
    with Runstate(api.url, api.key, max_retries=SDK_RETRIES, timeout=REQUEST_TIMEOUT_S) as rs:
        run = rs.scopes.create(name="waits")
        run_id, tasks = run.id, run.tasks
        ticket = tasks.submit(WAIT_MAILBOX, {"waited": True}, key="waited")

        def long_poll() -> None:
            seen["result"] = ticket.result(timeout_ms=20_000)

        def event_stream() -> None:
            types = []
            with api.client() as reader:
                with reader.stream("GET", "/v1/events/stream", params={"runId": run_id}) as response:
                    seen["stream_status"] = response.status_code
                    stream_open.set()
                    for line in response.iter_lines():
                        if line.startswith("data:"):
                            event = json.loads(line.removeprefix("data:"))
                            if event.get("subjectId") == ticket.id:
                                types.append(event["type"])
                                if event["type"] == "task.succeeded":
                                    break
            seen["stream"] = types

        threads = [threading.Thread(target=target, daemon=True) for target in (long_poll, event_stream)]
        for thread in threads:
            thread.start()
        assert stream_open.wait(REQUEST_TIMEOUT_S), "the event stream did not open"
        (claim,) = tasks.claim(WAIT_MAILBOX, max=1)
        claim.complete("released")
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), f"a wait was never released: {seen}"
    return seen


def assert_a_standby_refuses_writes_as_an_outage(api: ApiOnPair, bouncer, run_id: str) -> None:
    """PgBouncer pointed at the standby before its promotion (a failover manager's slip, or an old
    primary back as a standby): every write reaches a server that takes none, and is answered as an
    outage, 503 with Retry-After, on the hot path and on DRF's, never a 500."""
    writes = (
        ("submit (hot path)", f"/v1/mailboxes/{MAILBOX}/tasks", {"runId": run_id, "input": {}}),
        ("claim (hot path)", f"/v1/mailboxes/{MAILBOX}/claims", {"runId": run_id, "max": 1}),
        ("run create (DRF)", "/v1/runs", {"name": "on a standby"}),
    )
    bouncer.point_at(api.pair.standby)
    try:
        with api.client() as client:

            def answers() -> list[tuple[str, int, str | None, str]]:
                return [
                    (name, (r := client.post(path, json=body)).status_code, error_code(r), r.headers.get("Retry-After"))
                    for name, path, body in writes
                ]

            # The server connections PgBouncer held to the primary close as they are released.
            wait_until(lambda: answers()[0][1] == 503, what="PgBouncer to send writes to the standby")
            assert answers() == [(name, 503, "SERVICE_UNAVAILABLE", "1") for name, _, _ in writes]
    finally:
        bouncer.point_at(api.pair.primary)


def test_behind_pgbouncer_a_promoted_standby_takes_over_once_pgbouncer_is_pointed_at_it(behind_pgbouncer, tmp_path):
    api, bouncer = behind_pgbouncer
    pair = api.pair
    run_id = prepare_load(api)
    celery_run = prepare(api, CELERY_MAILBOX)  # a lease of 2 s
    assert_a_standby_refuses_writes_as_an_outage(api, bouncer, run_id)
    ledger_dir = tmp_path / "ledgers"
    ledger_dir.mkdir()
    worker = api.spawn("worker", worker_command(2, include=(CELERY_MODULE,)), **{LEDGER_DIR_ENV: str(ledger_dir)})
    api.spawn("beat", beat_command(tmp_path), **{LEDGER_DIR_ENV: str(ledger_dir)})
    answers = Answers()
    submitters = [
        Submitter(api, run_id, MAILBOX, max_retries=SDK_RETRIES, timeout_s=REQUEST_TIMEOUT_S, name=f"submitter-{index}")
        for index in range(SUBMITTERS)
    ]
    celery_submitter = Submitter(
        api,
        celery_run,
        CELERY_MAILBOX,
        task_input={"seconds": HANDLER_S},
        every_s=0.1,
        max_retries=SDK_RETRIES,
        timeout_s=REQUEST_TIMEOUT_S,
        name="celery-submitter",
    )
    for submitter in (*submitters, celery_submitter):
        answers.watch(submitter.http)
    claimers = [Claimer(api, run_id, answers, f"claimer-{index}") for index in range(CLAIMERS)]
    clients = [*submitters, celery_submitter, *claimers]
    for client in clients:
        client.start()
    try:
        wait_until(
            lambda: (
                sum(s.count() for s in submitters) >= 20
                and sum(c.count() for c in claimers) >= 10
                and len(pair.succeeded(celery_submitter.task_ids())) >= 5
            ),
            interval_s=0.25,
            what="the load to get going, the Celery worker's tasks included",
        )
        assert pair.sync_state() == "sync"

        answers.phase = "stopping"
        pair.primary.stop("immediate")
        stopped_at = time.monotonic()
        answers.phase = "down"
        refused_down = refused_without_a_primary(api, run_id, MAILBOX)
        time.sleep(max(0.0, NO_PRIMARY_FOR_S - (time.monotonic() - stopped_at)))

        answers.phase = "promoting"
        pair.standby.promote()
        promoted_at = time.monotonic()
        answers.phase = "promoted"  # PgBouncer still sends every transaction to the old host
        refused_promoted = refused_without_a_primary(api, run_id, MAILBOX)
        time.sleep(max(0.0, RELOAD_AFTER_S - (time.monotonic() - promoted_at)))

        answers.phase = "reloading"
        bouncer.point_at(pair.standby)  # what the failover manager does
        reloaded_at = time.monotonic()
        answers.phase = "after"
        wait_until(
            lambda: (
                sum(s.count(reloaded_at) for s in submitters) >= 10
                and sum(c.count(reloaded_at) for c in claimers) >= 5
                and celery_submitter.count(reloaded_at) >= 5
            ),
            limit_s=RESUME_LIMIT_S - (time.monotonic() - promoted_at),
            interval_s=0.05,
            what=f"submits and completes acknowledged within {RESUME_LIMIT_S} s of the promotion",
        )
    finally:
        for client in clients:
            client.stop()
    # The Celery worker, never restarted, does every acknowledged task of its mailbox.
    celery_tasks = celery_submitter.task_ids()
    wait_until(
        lambda: len(pair.succeeded(celery_tasks)) == len(celery_tasks),
        limit_s=DRAIN_TIMEOUT_S,
        interval_s=0.25,
        what="the Celery worker to complete every acknowledged submit",
        explain=lambda: api.task_states(celery_tasks),
    )
    api.assert_alive()
    done_by = {outcome["pid"] for _, _, outcome in pair.tasks(celery_submitter.task_ids(promoted_at)).values()}
    assert done_by == {worker.pid}, done_by
    first_submit = min(t for s in submitters for _, t, _ in s.acknowledged if t > promoted_at)
    first_complete = min(c.first(promoted_at) for c in claimers if c.first(promoted_at) is not None)

    # Without a primary: 503 in the envelope, with Retry-After, on the hot path and on DRF.
    for refused in (refused_down, refused_promoted):
        assert refused == [
            ("submit", 503, "SERVICE_UNAVAILABLE", "1"),
            ("run", 503, "SERVICE_UNAVAILABLE", "1"),
        ], f"{refused}\n{api.api_log()}"
    # Every request the SDK clients sent then was answered so, and every request got an answer.
    # A request PgBouncer held through its login retry (``server_login_retry``) can reach the new
    # primary once PgBouncer is pointed at it: done there, and answered after the RELOAD only.
    outage = answers.sent_in(*NO_PRIMARY)
    assert outage, "no client sent a request while there was no primary"
    refused = [(status, code) for _, _, status, code in outage if (status, code) == (503, "SERVICE_UNAVAILABLE")]
    held_until_the_reload = [
        answer for answer in outage if 200 <= answer[2] < 300 and answer[1] in ("reloading", "after")
    ]
    assert refused, Counter(outage)
    assert len(refused) + len(held_until_the_reload) == len(outage), Counter(outage)
    errors = [answer for answer in answers.answers if answer[2] >= 500 and answer[2] != 503]
    assert errors == [], f"{Counter(errors)}\n{api.api_log()}"
    assert answers.unanswered() == 0, f"{answers.unanswered()} requests never answered (sent: {answers.sent})"
    gave_up = [s.gave_up for s in (*submitters, celery_submitter)]
    assert gave_up == [[]] * len(gave_up), gave_up  # the SDK retried every submit through the outage

    # The LISTEN connection found the new primary by itself, directly (not through PgBouncer).
    def listening() -> bool:
        query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND query = 'LISTEN runstate'"
        return pair.sql(query, LISTEN_APP_NAME)[0][0] >= 1

    wait_until(listening, what="the LISTEN connection to reconnect to the promoted standby")
    assert pair.sql("SELECT pg_is_in_recovery(), inet_server_port()")[0] == (False, pair.standby.port)
    # Waits started after the switch are released by the complete that ends their task...
    seen = waits_are_released(api)
    assert (seen["result"]["state"], seen["result"]["outcome"]) == ("SUCCEEDED", "released"), seen
    assert seen["stream_status"] == 200 and seen["stream"][-1] == "task.succeeded", seen
    # ...and a notification sent through PgBouncer's new server reaches the API: a key it caches
    # for an hour is refused as soon as its revoke commits.
    key = create_key(api.env, PROJECT)
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=15) as client:
        assert client.get("/v1/runs").status_code == 200  # cached now
        assert bouncer.revoke_key(key) == 1
        wait_until(lambda: client.get("/v1/runs").status_code == 401, what="the revoked key refused")

    # The promoted standby holds to the ledger: every acknowledged submit and complete, none twice.
    paths = [*(client.ledger.path for client in clients), *sorted(ledger_dir.glob("*.jsonl"))]
    counts = api.check_ledgers(*paths, drained_runs=[celery_run])

    by_phase = Counter((sent, status) for sent, _, status, _ in answers.answers)
    taken_over = sum(1 for _, attempts, _ in pair.tasks(celery_tasks).values() if attempts > 1)
    held = Counter(answered for sent, answered, _, _ in answers.answers if sent == "stopping")
    print(
        f"\nfailover behind PgBouncer: no primary for {promoted_at - stopped_at:.2f} s, PgBouncer reloaded "
        f"{reloaded_at - promoted_at:.2f} s after the promotion; the first submit acknowledged "
        f"{first_submit - promoted_at:.2f} s after the promotion ({first_submit - reloaded_at:.2f} s after the "
        f"RELOAD), the first complete {first_complete - promoted_at:.2f} s after it "
        f"({first_complete - reloaded_at:.2f} s after the RELOAD); answers by (phase sent, status) "
        f"{dict(sorted(by_phase.items()))}; requests sent as the primary stopped, by phase answered {dict(held)}; "
        f"acknowledged: {sum(s.count() for s in submitters)} submits, {sum(c.count() for c in claimers)} "
        f"completes, {len(celery_tasks)} tasks done by the Celery worker "
        f"({taken_over} taken over after their lease); ledger {counts}"
    )
