# shellcheck shell=bash
# Helpers shared by scripts/start and scripts/test (sourced, never run on its own).
#
#   find_python           print the path of a Python >= 3.12, or stop with exit 1
#   ensure_venv           create .venv (or recreate a too-old one) and install requirements-dev.txt
#                         (the development lock: the runtime lock requirements.txt and the tests',
#                         linters' and benchmarks' tools, every package pinned with its hashes)
#                         and the checkout when the lock changed since the last install; puts
#                         .venv/bin first on PATH
#   pg_ensure_running     make sure PostgreSQL answers on 127.0.0.1:5432
#   pg_ensure_connections N
#                         make sure the local PostgreSQL allows N sessions (raise max_connections
#                         and restart it when it allows fewer)
#   redis_ensure_running  make sure Redis answers on 127.0.0.1:6379
#
# Every helper runs from the repository root, so pyenv's .python-version (3.12) applies.

RUNSTATE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUNSTATE_VENV="$RUNSTATE_ROOT/.venv"
RUNSTATE_MIN_PYTHON="3.12"

say() { printf '==> %s\n' "$*"; }
die() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

# Succeeds when "$1" runs and is Python >= 3.12.
_python_ok() {
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
    local candidate path
    # A pyenv shim (python3.12, python3, ...) resolves through .python-version at the repo root.
    for candidate in python3.12 python3.13 python3 python; do
        path="$(cd "$RUNSTATE_ROOT" && command -v "$candidate" 2>/dev/null)" || continue
        if (cd "$RUNSTATE_ROOT" && _python_ok "$path"); then
            # Resolve a shim to the real interpreter so the venv does not depend on pyenv's state.
            (cd "$RUNSTATE_ROOT" && "$path" -c 'import sys; print(sys.executable)')
            return 0
        fi
    done
    # pyenv installed but its shims are not on PATH (or do not resolve): use its versions directly.
    for path in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
        if [ -x "$path" ] && _python_ok "$path"; then
            printf '%s\n' "$path"
            return 0
        fi
    done
    printf 'error: runstate needs Python >= %s (Django 6 requires it), and none was found.\n' \
        "$RUNSTATE_MIN_PYTHON" >&2
    printf '       Tried python3.12, python3.13, python3, python and %s/versions/3.1[2-9]*.\n' \
        "${PYENV_ROOT:-$HOME/.pyenv}" >&2
    printf '       Install one (e.g. "pyenv install 3.12") and run this command again.\n' >&2
    exit 1
}

_sha256() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        "$RUNSTATE_VENV/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"
    fi
}

ensure_venv() {
    local python stamp wanted
    if [ ! -x "$RUNSTATE_VENV/bin/python" ] || ! _python_ok "$RUNSTATE_VENV/bin/python"; then
        python="$(find_python)" || exit 1
        say "Creating .venv with $python ($("$python" -V 2>&1))"
        "$python" -m venv --clear "$RUNSTATE_VENV" || die "could not create $RUNSTATE_VENV"
    fi
    stamp="$RUNSTATE_VENV/.requirements.sha256"
    wanted="$(_sha256 "$RUNSTATE_ROOT/requirements-dev.txt")"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
        say "Installing requirements-dev.txt into .venv"
        # The development lock (pip-compile --generate-hashes, from requirements-dev.in, which
        # holds the runtime requirements.in and is constrained by its lock): pip refuses any
        # download whose hash is not in it, and any package it does not pin. A deployment
        # installs the runtime lock, requirements.txt, alone (docs/deploy.md, "Installing").
        "$RUNSTATE_VENV/bin/python" -m pip install --quiet --require-hashes -r "$RUNSTATE_ROOT/requirements-dev.txt" \
            </dev/null || die "pip install --require-hashes -r requirements-dev.txt failed"
        # The checkout itself, editable (the runstate command): an editable cannot be hashed,
        # and its dependencies are the lock's, so none is resolved here.
        (cd "$RUNSTATE_ROOT" && "$RUNSTATE_VENV/bin/python" -m pip install --quiet --no-deps -e . </dev/null) ||
            die "pip install --no-deps -e . failed"
        printf '%s\n' "$wanted" >"$stamp"
    else
        say "Requirements already installed in .venv"
    fi
    export VIRTUAL_ENV="$RUNSTATE_VENV"
    export PATH="$RUNSTATE_VENV/bin:$PATH"
}

# Wait up to $1 seconds for the command "${@:2}" to succeed.
_wait_for() {
    local seconds="$1" i
    shift
    for ((i = 0; i < seconds * 2; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    return 1
}

pg_ensure_running() {
    local version
    command -v pg_isready >/dev/null 2>&1 || die "pg_isready not found: install PostgreSQL or set DATABASE_URL"
    if pg_isready -q -h 127.0.0.1 -p 5432; then
        say "PostgreSQL is answering on 127.0.0.1:5432"
        return 0
    fi
    command -v pg_ctlcluster >/dev/null 2>&1 ||
        die "PostgreSQL is not answering on 127.0.0.1:5432 and pg_ctlcluster is missing: start it or set DATABASE_URL"
    version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)"
    [ -n "$version" ] || die "no cluster under /etc/postgresql: start PostgreSQL or set DATABASE_URL"
    say "Starting PostgreSQL $version (cluster main)"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start ||
        die "pg_ctlcluster $version main start failed"
    _wait_for 30 pg_isready -q -h 127.0.0.1 -p 5432 ||
        die "PostgreSQL did not answer on 127.0.0.1:5432 within 30 s"
    say "PostgreSQL is answering on 127.0.0.1:5432"
}

_pg_setting() {
    psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -XAtqc "SHOW $1" </dev/null 2>/dev/null
}

# The test runs go at the same time against one server, each with its live API servers,
# workers and pools: together they have peaked at 83 sessions, and PostgreSQL's default of
# 100 then refused a connection ("sorry, too many clients already") to whichever run asked
# next. The cluster this script starts is the developer's or CI's own, so its limit is
# raised (ALTER SYSTEM, which needs a restart) rather than each run squeezed under it.
pg_ensure_connections() {
    local wanted="$1" have version
    have="$(_pg_setting max_connections)" || die "could not read max_connections from 127.0.0.1:5432"
    if [ "$have" -ge "$wanted" ]; then
        say "PostgreSQL allows $have sessions (the test runs want $wanted)"
        return 0
    fi
    command -v pg_ctlcluster >/dev/null 2>&1 ||
        die "PostgreSQL on 127.0.0.1:5432 allows $have sessions, the test runs want $wanted, and pg_ctlcluster is missing: raise max_connections or set DATABASE_URL"
    version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n1)"
    say "PostgreSQL allows $have sessions, the test runs want $wanted: ALTER SYSTEM SET max_connections = $wanted, and a restart"
    psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -XAtqc "ALTER SYSTEM SET max_connections = $wanted" </dev/null ||
        die "ALTER SYSTEM SET max_connections failed"
    pg_ctlcluster --skip-systemctl-redirect "$version" main restart ||
        die "pg_ctlcluster $version main restart failed"
    _wait_for 30 pg_isready -q -h 127.0.0.1 -p 5432 ||
        die "PostgreSQL did not answer on 127.0.0.1:5432 within 30 s of its restart"
    have="$(_pg_setting max_connections)"
    [ "$have" -ge "$wanted" ] || die "PostgreSQL still allows $have sessions after its restart (wanted $wanted)"
    say "PostgreSQL allows $have sessions"
}

_redis_ping() { [ "$(redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null)" = "PONG" ]; }

redis_ensure_running() {
    command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found: install Redis or set CELERY_BROKER_URL"
    if _redis_ping; then
        say "Redis is answering on 127.0.0.1:6379"
        return 0
    fi
    command -v redis-server >/dev/null 2>&1 ||
        die "Redis is not answering on 127.0.0.1:6379 and redis-server is missing: start it or set CELERY_BROKER_URL"
    say "Starting redis-server on 127.0.0.1:6379"
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log || die "redis-server failed to start"
    _wait_for 30 _redis_ping || die "Redis did not answer on 127.0.0.1:6379 within 30 s"
    say "Redis is answering on 127.0.0.1:6379"
}
