"""The hot path's database: a psycopg async connection pool on the event loop that serves the API.

Its connections are configured as Django's (``DatabaseWrapper.get_connection_params``: the
same server, the same adapters, so ``jsonb`` arrives as text for ``JSONField`` and times in
UTC, the same prepare threshold) and run in autocommit: each hot statement is one
transaction, as it is when the services run it outside ``transaction.atomic``.

A pool belongs to the event loop that opened it; a process has one loop (uvicorn), tests
may run several in turn, and each gets a pool of its own.
"""

import asyncio
from collections.abc import Callable

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, IntegrityError, InterfaceError, OperationalError, connections
from opentelemetry import context as otel_context
from psycopg import AsyncConnection, AsyncCursor
from psycopg import IntegrityError as PsycopgIntegrityError
from psycopg import InterfaceError as PsycopgInterfaceError
from psycopg import OperationalError as PsycopgOperationalError
from psycopg.errors import ReadOnlySqlTransaction
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from runstate_project.postgresql.base import SERVER_WROTE, idle_connection_problem

_pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool] = {}
# How long a request waits for one of the pool's connections before it is handed to the DRF
# path, whose pool answers 503 at once while the server is down, or waits while it is busy
# (runstate_project/postgresql); the same grace that pool gives a request.
READY_GRACE_S = 0.25


class NoConnection(Exception):
    """No connection of the hot pool was ready in time: the DRF path answers the request."""


def _connection_kwargs() -> dict:
    params = dict(connections[DEFAULT_DB_ALIAS].get_connection_params())
    params.pop("cursor_factory", None)  # Django's sync cursor classes; the async default binds on the server
    params["autocommit"] = True
    params["cursor_factory"] = AsyncCursor
    return params


async def _check(conn: AsyncConnection) -> None:
    """Refuse a pooled connection the server has closed (a restart, a failover), as the DRF path's pool does.

    No round trip: ``idle_connection_problem`` looks at the socket. Without it, each
    connection left in the pool across a restart answered one request ``503``.
    """
    problem = idle_connection_problem(conn.pgconn)
    if problem == SERVER_WROTE:
        await conn.close()
    if problem is not None:
        raise PsycopgOperationalError(problem)


async def _configure(conn: AsyncConnection) -> None:
    # What Django's ``_configure_timezone`` does on a new connection.
    if conn.info.parameter_status("TimeZone") != "UTC" and settings.USE_TZ:
        await conn.execute("SET TIME ZONE 'UTC'")


async def pool() -> AsyncConnectionPool:
    """Return this event loop's pool, opened at first use."""
    loop = asyncio.get_running_loop()
    found = _pools.get(loop)
    if found is None:
        found = AsyncConnectionPool(
            kwargs=_connection_kwargs(),
            min_size=1,
            max_size=settings.RUNSTATE_HOT_POOL_SIZE,
            timeout=settings.RUNSTATE_HOT_POOL_TIMEOUT_S,
            configure=_configure,
            check=_check,
            open=False,
            name="runstate-hot",
        )
        _pools[loop] = found
        # Outside the span of the request that opens it: the pool's workers keep the context
        # they start in, and that span would be the parent of every span they make (a new
        # connection's set-up statement).
        token = otel_context.attach(otel_context.Context())
        try:
            await found.open(wait=False)
        finally:
            otel_context.detach(token)
    return found


async def fetch(statement: str, params: dict, *, sent: Callable[[], None] | None = None) -> list[tuple]:
    """Run one statement in a transaction of its own and return its rows.

    A connection that fails raises Django's ``OperationalError``, which the API answers
    ``503 SERVICE_UNAVAILABLE`` as it does on the DRF path, a constraint it breaks Django's
    ``IntegrityError``; no connection ready within
    ``READY_GRACE_S`` raises ``NoConnection`` (nothing was sent). ``sent`` is called when the
    statement is about to be sent, its connection taken (a wait's shared first read:
    ``longpoll.Watch.first_read``).
    """
    try:
        async with (await pool()).connection(timeout=READY_GRACE_S) as conn, conn.cursor() as cursor:
            if sent is not None:
                sent()
            await cursor.execute(statement, params)
            return await cursor.fetchall()
    except PoolTimeout:
        raise NoConnection() from None
    except PsycopgOperationalError as error:
        raise OperationalError(str(error)) from error
    except ReadOnlySqlTransaction as error:  # a standby: an outage, as on the DRF path
        raise OperationalError(str(error)) from error
    except PsycopgInterfaceError as error:
        raise InterfaceError(str(error)) from error
    except PsycopgIntegrityError as error:  # the statement wrote nothing; its caller decides
        raise IntegrityError(str(error)) from error


async def close() -> None:
    """Close this event loop's pool (tests; a process's pool lives as long as it does)."""
    found = _pools.pop(asyncio.get_running_loop(), None)
    if found is not None:
        await found.close()
