"""Django's PostgreSQL backend whose connection pool answers at once while the server is down.

psycopg_pool makes a request that finds no connection ready wait, up to the pool timeout
(30 s by default), while it connects in the background. That is right when the pool is
merely busy, but while the server is down the background connects fail and retry with a
growing backoff, so every request would hang for the whole timeout before its 503: longer
than a client waits. Here a request that gets no connection within a short grace checks
whether the server accepts a connection at all; if it does not, the request fails at once
with that error (an ``OperationalError``: ``503 SERVICE_UNAVAILABLE``); otherwise — the
server accepts one, or refuses only because it is full — it waits for the pool as before.
One check serves every request of the process for a second.
"""

import select
import threading
import time

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.db.backends.postgresql import base
from psycopg.pq import ConnStatus, TransactionStatus
from psycopg_pool import ConnectionPool, PoolTimeout

# How long a request waits for a pooled connection before checking that the server is up.
READY_GRACE_S = 0.25
# How long one check's answer holds for every request of the process.
PROBE_TTL_S = 1.0
PROBE_CONNECT_TIMEOUT_S = 2


# How PostgreSQL refuses a connection when it is up but has no slot left (max_connections,
# a role's or a database's CONNECTION LIMIT). psycopg gives such a refusal no SQLSTATE, only
# the server's message (FATAL 53300), so the message is what tells it from a server that is down.
FULL_SERVER_MESSAGES = ("too many clients", "too many connections", "remaining connection slots")


def _server_is_full(refused: Exception) -> bool:
    message = str(refused).lower()
    return any(full in message for full in FULL_SERVER_MESSAGES)


# PostgreSQL's "cannot execute ... in a read-only transaction": a write reached a standby (a
# pooler pointed at one not yet promoted, or at an old primary that came back as a standby).
READ_ONLY_SQLSTATE = "25006"


def read_only_server(error: BaseException) -> bool:
    """Return whether ``error`` (psycopg's, or Django's wrapping it) is a write refused by a server that takes none.

    psycopg raises it as an ``InternalError``, but for the caller it is an outage like a
    server that is down: the primary is elsewhere for now, and the same call succeeds once
    the connection reaches it. The API answers it ``503``, the workers ride it out.
    """
    for each in (error, error.__cause__):
        if getattr(each, "sqlstate", None) == READ_ONLY_SQLSTATE:
            return True
    return False


# Why ``idle_connection_problem`` refuses a connection.
NOT_IDLE = "the pooled connection is not idle"
SERVER_WROTE = "the server closed the pooled connection, or wrote to it unasked"


def idle_connection_problem(pgconn) -> str | None:
    """Say why a pooled connection cannot serve (``None`` when it can), without a round trip to the server.

    psycopg_pool's own check (``ConnectionPool.check_connection``) sends an empty query on
    every checkout: a round trip per request. An idle connection has nothing to read, so a
    socket with something to read means the server wrote to it unasked: the notice it sends
    when it shuts down or ends the session (a restart, a failover, ``pg_terminate_backend``),
    or the end of the stream (``SERVER_WROTE``: the connection must be closed, or the pool
    would take it back as good). A connection that died silently (a network partition)
    still fails on its first query, with ``503 SERVICE_UNAVAILABLE``, as it would after any
    check.
    """
    if pgconn.status != ConnStatus.OK or pgconn.transaction_status != TransactionStatus.IDLE:
        return NOT_IDLE
    readable, _, _ = select.select([pgconn.socket], [], [], 0)
    return SERVER_WROTE if readable else None


def check_idle_connection(conn: psycopg.Connection) -> None:
    """Refuse a connection ``idle_connection_problem`` finds unusable (the pool's ``check``: it hands out another)."""
    problem = idle_connection_problem(conn.pgconn)
    if problem == SERVER_WROTE:
        conn.close()
    if problem is not None:
        raise psycopg.OperationalError(problem)


class FailFastPool(ConnectionPool):
    """A pool whose ``getconn`` fails at once, rather than after its timeout, when the server is down."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._probe_lock = threading.Lock()
        self._probed_at = float("-inf")
        self._probe_error: Exception | None = None

    def getconn(self, timeout: float | None = None):  # noqa: D102 - see the class
        total = self.timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            return super().getconn(min(READY_GRACE_S, total))
        except PoolTimeout:
            error = self._server_error()
            if error is not None:
                raise error from None
            remaining = total - (time.monotonic() - started)
            if remaining <= 0:
                raise
        return super().getconn(remaining)

    def _server_error(self) -> Exception | None:
        """Return why the server refuses a new connection (None if it accepts one), checked at most once a second."""
        with self._probe_lock:
            if time.monotonic() - self._probed_at < PROBE_TTL_S:
                return self._probe_error
            kwargs = {**self._resolve_kwargs(), "connect_timeout": PROBE_CONNECT_TIMEOUT_S}
            try:
                self.connection_class.connect(self._resolve_conninfo(), **kwargs).close()
            except Exception as refused:  # noqa: BLE001 - any refusal means the server is not there...
                # ...unless it is there but full: then the pool's own connections will come back.
                self._probe_error = None if _server_is_full(refused) else refused
            else:
                self._probe_error = None
            self._probed_at = time.monotonic()
            return self._probe_error


class DatabaseWrapper(base.DatabaseWrapper):
    """PostgreSQL through a ``FailFastPool`` when ``OPTIONS["pool"]`` is set."""

    @property
    def pool(self):  # noqa: D102 - Django's, with FailFastPool
        pool_options = self.settings_dict["OPTIONS"].get("pool")
        if self.alias == base.NO_DB_ALIAS or not pool_options:
            return None
        if self.alias not in self._connection_pools:
            if self.settings_dict.get("CONN_MAX_AGE", 0) != 0:
                raise ImproperlyConfigured("Pooling doesn't support persistent connections.")
            connect_kwargs = self.get_connection_params()
            # Autocommit as Django expects; it sets what it needs once it has the connection.
            connect_kwargs["autocommit"] = True
            pool = FailFastPool(
                kwargs=connect_kwargs,
                open=False,
                configure=self._configure_connection,
                check=check_idle_connection if self.settings_dict["CONN_HEALTH_CHECKS"] else None,
                **({} if pool_options is True else pool_options),
            )
            # The first thread to build a pool wins (none is opened until it is used).
            self._connection_pools.setdefault(self.alias, pool)
        return self._connection_pools[self.alias]
