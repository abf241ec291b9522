"""Task throughput: submit -> claim -> complete on PostgreSQL, against pgbench -N and pgqueuer.

    .venv/bin/python -m bench.throughput [--tasks N] [--workers 4[,8]] [--modes unbatched,batched]
                                         [--no-http] [--http-processes 2] [--no-sdk] [--no-pgqueuer]
                                         [--tracing] [--pgbouncer] [--json PATH] [--record]

For each worker count W (4 unless ``--workers`` says otherwise) it measures, in this order
and never overlapping:

* service layer, per mode: N tasks submitted by W threads, then W worker threads claiming
  and completing until the run is empty. *unbatched*: ``task_submit`` per task,
  ``task_claim(max_claims=B)`` (``--batch``, 10), ``claim_complete`` per claim; *batched*:
  ``tasks_submit_many`` of 100, ``task_claim`` of 50, ``claims_complete_many`` of 50
  (``--batched-sizes``);
* HTTP (``--http``, on by default), through uvicorn on 127.0.0.1 with ``--http-processes``
  worker processes (2), driven by W threads with keep-alive ``httpx.Client``s, per
  ``--http-modes``: *unbatched* (one submit per task, claims of ``--batch``, one complete
  per claim) and *batched* (the batch endpoints: submits of 100, claims of 50, completes of
  50, as ``--batched-sizes``); with ``--tracing``, the unbatched one again on a second server
  with tracing on (``OTEL_TRACES_SAMPLER=always_on``, the batch span processor, OTLP/HTTP to a
  local receiver that discards), right after the untraced one (``http_unbatched_tracing``);
  with ``--pgbouncer``, each HTTP pipeline again right after its direct one, on a server whose
  ``DATABASE_URL`` goes through a PgBouncer in transaction mode started here on a free port
  (``--pgbouncer-pool-size`` server connections, 10; bench/pooler.py), prepared statements off
  and the LISTEN connection direct, as docs/deploy.md deploys it (``http_unbatched_pgbouncer``,
  ``http_batched_pgbouncer``; PgBouncer's CPU and its transactions and queries per task too);
* baseline: ``pgbench -N -c W -j W -T 15`` against the same PostgreSQL server.

With the HTTP server up, once: the server's CPU per unbatched request of each kind (submit,
claim of 1, complete; ``--cost-calls`` of each, one at a time from one client, the uvicorn
processes' CPU time divided by the calls; with ``--pgbouncer`` the pooled server's too, and
PgBouncer's), and the SDK scenario (``--sdk``): a backlog of
the HTTP N tasks submitted with ``submit_many``, drained by the SDK's real ``consume`` loop
(``AsyncRunstate``, ``--sdk-concurrency`` 8) in this process.

Then, once, the same-run peer (``--pgqueuer``, on by default; bench/pgqueuer_peer.py):
pgqueuer draining N no-op jobs enqueued beforehand with 5 dequeuers x batch 10, in a
database of its own. It needs pgqueuer (requirements-dev.txt); without it the benchmark stops.

Before any timing it counts the SQL statements of one call of each kind in each mode
(service layer, ``CaptureQueriesContext``) and of one request of each kind (in-process
Django test client, every connection counted). Every scenario is verified afterwards with
one query: N tasks, all ``SUCCEEDED`` with ``attempts == 1``, N ``task.succeeded`` events;
and over its two phases, per task: the CPU of the benchmark database's backends (every one
connected to it, read from /proc: the API servers' and PgBouncer's too, no other database's),
and the WAL written, the whole server's (``pg_current_wal_lsn()`` before and after, other
sessions' writes too) and the benchmark database's alone (its records read back with
``pg_walinspect``, when the role may create it).

The database (``DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432/runstate_bench``)
is created when missing and migrated; when its name contains ``bench`` the coordination
tables are truncated before each scenario (otherwise each scenario only uses its own fresh
project and run). ``--record`` appends the figures to docs/benchmarks.md; ``--json PATH``
writes the W = 4 figures as JSON.

The measures live one to a module beside this one (service, http_pipeline, request_costs,
sdk_drain, peer, statements); what every benchmark shares (servers, meters, pgbench, the
database) lives in bench/harness/. ``cli`` runs them in the order above.

Not a test: pytest never collects this package (see bench/__init__.py).
"""
