"""Servers of this machine's own that the tests and the benchmarks start: free ports, PgBouncer.

Shared by ``tests/`` and ``bench/`` (a benchmark imports nothing from ``tests/``); nothing
here is part of runstate as it is deployed.
"""

# The OS user PostgreSQL and PgBouncer run as when the caller is root (both refuse root).
PG_OS_USER = "postgres"
