"""Per-key rate limits: ``429 RATE_LIMITED`` with ``Retry-After``.

Each API key may make ``RUNSTATE_RATE_LIMIT`` requests (``"<count>/<period>"``, period
``s``, ``min``, ``h`` or ``day``; ``"0"`` or ``"off"`` disables) per window. A window
starts with the key's first request and lasts one period; ``Retry-After`` says when it
ends. The count lives in Redis when the broker is Redis (``CELERY_BROKER_URL`` is
``redis://`` or ``rediss://``), so every API process shares it; otherwise each process
counts on its own. If Redis does not answer, the process falls back to its own count
rather than refusing or waiting: a limit is a guard, not a dependency.
"""

import asyncio
import logging
import math
import threading
import time
from dataclasses import dataclass

from django.conf import settings
from rest_framework.throttling import BaseThrottle

logger = logging.getLogger(__name__)

_PERIODS_S = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}
_PERIODS_S |= {"d": 86400, "day": 86400}
REDIS_TIMEOUT_S = 0.25
# A connect gets longer: a process's first burst opens its pool's connections all at once,
# and on a loaded machine those connects outlasted 0.25 s, so a healthy Redis was counted
# as down for ``REDIS_BACKOFF_S``. A Redis that refuses connections still fails at once.
REDIS_CONNECT_TIMEOUT_S = 1.0
# After a Redis error, count locally for this long before trying Redis again.
REDIS_BACKOFF_S = 5.0
# A process's Redis connections for its counts (the request threads' and each event loop's):
# a burst beyond them waits up to ``REDIS_POOL_WAIT_S`` for one rather than failing, as
# redis-py's default pools do past 100 ("Too many connections"), which would count locally
# for ``REDIS_BACKOFF_S``.
REDIS_CONNECTIONS = 32
REDIS_POOL_WAIT_S = 1.0


@dataclass(frozen=True)
class Rate:
    """``count`` requests per ``period_s`` seconds."""

    count: int
    period_s: int


def parse_rate(text: str) -> Rate | None:
    """Parse ``"6000/min"``; return None when limits are off (``"0"``, ``"off"``, empty)."""
    text = (text or "").strip().lower()
    if text in {"", "0", "off", "none"}:
        return None
    try:
        count_text, period_text = text.split("/", 1)
        count = int(count_text)
        multiple = "".join(ch for ch in period_text if ch.isdigit()) or "1"
        unit = period_text.lstrip("0123456789")
        period_s = int(multiple) * _PERIODS_S[unit]
    except (ValueError, KeyError):
        raise ValueError(f"RUNSTATE_RATE_LIMIT must look like '6000/min', not {text!r}") from None
    if count <= 0:
        return None
    return Rate(count, period_s)


class LocalWindows:
    """Windows counted in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int]] = {}

    def hit(self, key: str, rate: Rate, cost: int = 1) -> tuple[int, float]:
        """Count ``cost`` requests; return the window's count and the seconds until it ends."""
        now = time.monotonic()
        with self._lock:
            ends_at, count = self._windows.get(key, (0.0, 0))
            if ends_at <= now:
                ends_at, count = now + rate.period_s, 0
                if len(self._windows) > 100_000:  # forget ended windows now and then
                    self._windows = {k: v for k, v in self._windows.items() if v[0] > now}
            count += cost
            self._windows[key] = (ends_at, count)
        return count, ends_at - now


# One round trip and one command (EVALSHA): the window starts, with its expiry, at its first
# request; later requests only add to it. Atomic, as every Lua script is.
_COUNT_SCRIPT = """
local count = redis.call('INCRBY', KEYS[1], ARGV[1])
if count == tonumber(ARGV[1]) then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return {count, redis.call('PTTL', KEYS[1])}
"""


class RedisWindows:
    """Windows counted in Redis, shared by every process using the same broker."""

    def __init__(self, url: str) -> None:
        import redis

        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=REDIS_CONNECTIONS,
            timeout=REDIS_POOL_WAIT_S,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        )
        self._client = redis.Redis(connection_pool=pool)
        self._count = self._client.register_script(_COUNT_SCRIPT)

    def hit(self, key: str, rate: Rate, cost: int = 1) -> tuple[int, float]:
        """Count ``cost`` requests; return the window's count and the seconds until it ends."""
        count, ttl_ms = self._count(keys=[_window(key, rate)], args=[cost, rate.period_s * 1000])
        return int(count), max(int(ttl_ms), 0) / 1000


class AsyncRedisWindows:
    """The same windows, counted from an event loop (the API's hot path) without blocking it."""

    def __init__(self, url: str) -> None:
        import redis.asyncio

        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=REDIS_CONNECTIONS,
            timeout=REDIS_POOL_WAIT_S,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        )
        self._client = redis.asyncio.Redis(connection_pool=pool)
        self._count = self._client.register_script(_COUNT_SCRIPT)

    async def hit(self, key: str, rate: Rate, cost: int = 1) -> tuple[int, float]:
        """Count ``cost`` requests; return the window's count and the seconds until it ends."""
        count, ttl_ms = await self._count(keys=[_window(key, rate)], args=[cost, rate.period_s * 1000])
        return int(count), max(int(ttl_ms), 0) / 1000


def _window(key: str, rate: Rate) -> str:
    return f"runstate:ratelimit:{key}:{rate.count}/{rate.period_s}"


class Limiter:
    """Redis windows when the broker is Redis, else (and while Redis fails) local ones."""

    def __init__(self) -> None:
        self.local = LocalWindows()
        self._redis: RedisWindows | None = None
        self._redis_url: str | None = None
        self._redis_down_until = 0.0
        self._async: dict[asyncio.AbstractEventLoop, tuple[str, AsyncRedisWindows]] = {}

    def _shared_url(self) -> str | None:
        url = settings.CELERY_BROKER_URL
        if not url.startswith(("redis://", "rediss://")) or time.monotonic() < self._redis_down_until:
            return None
        return url

    def _shared(self) -> RedisWindows | None:
        url = self._shared_url()
        if url is None:
            return None
        if self._redis is None or self._redis_url != url:
            self._redis, self._redis_url = RedisWindows(url), url
        return self._redis

    def _redis_failed(self) -> None:
        logger.warning("rate limit: Redis unavailable, counting in-process", exc_info=True)
        self._redis_down_until = time.monotonic() + REDIS_BACKOFF_S

    def hit(self, key: str, rate: Rate, cost: int = 1) -> tuple[int, float]:
        """Count ``cost`` requests of ``key``; return the window's count and seconds until it ends."""
        shared = self._shared()
        if shared is not None:
            try:
                return shared.hit(key, rate, cost)
            except Exception:  # noqa: BLE001 - any Redis failure: count locally for a while
                self._redis_failed()
        return self.local.hit(key, rate, cost)

    async def ahit(self, key: str, rate: Rate, cost: int = 1) -> tuple[int, float]:
        """``hit``, from an event loop: Redis is asked without blocking the loop (a client per loop)."""
        url = self._shared_url()
        if url is not None:
            loop = asyncio.get_running_loop()
            found = self._async.get(loop)
            if found is None or found[0] != url:
                for ended in [other for other in self._async if other.is_closed()]:
                    del self._async[ended]
                found = self._async[loop] = (url, AsyncRedisWindows(url))
            try:
                return await found[1].hit(key, rate, cost)
            except Exception:  # noqa: BLE001 - any Redis failure: count locally for a while
                self._redis_failed()
        return self.local.hit(key, rate, cost)


limiter = Limiter()


def request_cost(request, view) -> int:
    """How many requests a call counts as: the items of a batch view (``batch_field``), else one."""
    if getattr(view, "batch_field", None) is None:
        return 1
    # Reading the body here parses it once (DRF caches it); a body that does not parse is
    # answered 400 from here, as the view would.
    return body_cost(view, request.data)


def body_cost(view, data: object) -> int:
    """How many requests a parsed body counts as for ``view``: its ``batch_field``'s items, else one."""
    field = getattr(view, "batch_field", None)
    items = data.get(field) if field is not None and isinstance(data, dict) else None
    return max(1, len(items)) if isinstance(items, list) else 1


def rate_wait(api_key_id: object, cost: int = 1) -> int | None:
    """Count ``cost`` requests of a key; return the seconds to wait when it is over its limit, else None."""
    rate = parse_rate(settings.RUNSTATE_RATE_LIMIT)
    if rate is None:
        return None
    return _wait(rate, *limiter.hit(str(api_key_id), rate, cost))


async def rate_wait_async(api_key_id: object, cost: int = 1) -> int | None:
    """``rate_wait`` from an event loop (the API's hot path)."""
    rate = parse_rate(settings.RUNSTATE_RATE_LIMIT)
    if rate is None:
        return None
    return _wait(rate, *await limiter.ahit(str(api_key_id), rate, cost))


def _wait(rate: Rate, count: int, remaining_s: float) -> int | None:
    return None if count <= rate.count else max(1, math.ceil(remaining_s))


# Set on a Django request the hot path (``coordination/api/hot``) counted already, before it
# handed the request to its view: the view's throttle must not count it twice.
COUNTED_ATTRIBUTE = "runstate_rate_counted"


class ApiKeyRateThrottle(BaseThrottle):
    """Limit each API key to ``RUNSTATE_RATE_LIMIT`` requests per window; a batch counts its items."""

    def __init__(self) -> None:
        self._wait: float | None = None

    def allow_request(self, request, view) -> bool:  # noqa: D102
        principal = request.user
        api_key = getattr(principal, "api_key", None)
        if api_key is None:
            return True  # unauthenticated views (health, schema, metrics); auth refuses the rest
        if getattr(request._request, COUNTED_ATTRIBUTE, False):
            return True
        self._wait = rate_wait(api_key.id, request_cost(request, view))
        return self._wait is None

    def wait(self) -> float | None:  # noqa: D102
        return self._wait
