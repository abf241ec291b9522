"""Celery throughput: tasks through ``@runstate_task`` against a plain Celery no-op, same run, same worker.

    .venv/bin/python -m bench.celery [--tasks N] [--processes 2,4] [--submitters S] [--record] [--json PATH]

For each worker size W (prefork, ``--concurrency=W``), one ``celery worker`` process serves
both scenarios, one after the other:

* plain: N messages of a plain ``@shared_task`` whose body is one Redis ``INCR`` (how the
  benchmark learns it ran); time from the first send until the counter reaches N;
* runstate: N ``noop.submit(run, {})`` calls (a task row, its event, the Celery message
  after commit), each executed by the decorated no-op (claim by id under a lease, the
  process's shared renewer, complete); time from the first submit until N tasks are
  ``SUCCEEDED``.

S threads (``--submitters``, default 2) send or submit in both scenarios; the submitting
process keeps mailboxes in its process cache, as API and worker processes do. The ratio
runstate / plain is what the guarantees cost: two short transactions per task (claim,
complete) plus the submit's, on PostgreSQL. Afterwards one query checks every task
``SUCCEEDED`` exactly once (``attempts = 1``, N ``task.succeeded`` events).

Drain scenarios also report CPU milliseconds per task: the worker's (its main process and
pool children, from /proc) and PostgreSQL's (the backends connected to the benchmark
database, polled every 0.1 s from ``pg_stat_activity``; a backend that comes and goes
between two polls is missed, so with a connection per task that figure is a lower bound).
``--json PATH`` writes the figures of 2 worker processes (``plain_drain_per_s``,
``runstate_drain_per_s``, ``ratio_drain``, ``plain_pipeline_per_s``,
``runstate_pipeline_per_s``, ``ratio_pipeline``, and the CPU figures) and of every size.

Needs PostgreSQL (``DATABASE_URL``, default
``postgres://postgres@127.0.0.1:5432/runstate_bench_celery``, created and migrated when
missing) and Redis (``--broker``, default ``redis://127.0.0.1:6379/12``; the benchmark
FLUSHES that Redis database). ``--record`` appends the figures to docs/benchmarks.md.
Not a test: pytest never collects this package. ``tasks`` holds the two no-ops (the worker
imports it), ``figures`` what ``--json`` writes, ``__main__`` the run.
"""
