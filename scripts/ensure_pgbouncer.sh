#!/usr/bin/env bash
# Install Debian's PgBouncer for the tests that run runstate behind it (tests/reliability/
# test_pgbouncer.py, which start their own PostgreSQL cluster and their own PgBouncer).
#
#   scripts/ensure_pgbouncer.sh
#
# Idempotent: does nothing when `pgbouncer` is already there. Needs root (apt-get); when it
# cannot install, it says so and exits non-zero, and those tests then fail with a message
# naming this script (RUNSTATE_TEST_SKIP_PGBOUNCER=1 makes them skip instead). Installing the
# package starts no server the tests use: they run the program on a port of their own.
set -uo pipefail

found() { command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; }

if found; then
    echo "==> PgBouncer is installed: $(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
    exit 0
fi
echo "==> Installing Debian's pgbouncer (tests/reliability/test_pgbouncer.py)"
if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    echo "error: pgbouncer is missing and installing it needs root (apt-get install pgbouncer)" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -qq pgbouncer </dev/null || { $SUDO apt-get update -qq </dev/null && $SUDO apt-get install -y -qq pgbouncer </dev/null; }
status=$?
if [ $status -ne 0 ] || ! found; then
    echo "error: could not install pgbouncer (apt-get exit status $status)" >&2
    exit 1
fi
echo "==> PgBouncer is installed: $(command -v pgbouncer || echo /usr/sbin/pgbouncer)"
