"""An API process that is stopping: its streams end and its waits answer, so that it exits at once.

On SIGTERM or SIGINT, uvicorn (and gunicorn's uvicorn worker) stops taking connections and
waits for every response in flight to end before the process exits. A claim watch or an event
stream never ends by itself, and a long-poll only when its wait runs out: a process with one
worker's watch open waited out its whole grace (15 s in ``scripts/start``) and was killed.
Once the process is *draining*:

- every Server-Sent Events stream (``/v1/claims/watch``, ``/v1/events/stream``, the dashboard's)
  ends once it has sent what it has: its client reconnects with ``Last-Event-ID`` (to another
  process, or this one restarted) and misses nothing;
- every long-poll (a claim, a wait on a task, group, barrier or timer, ``GET /v1/events``)
  answers at once what its last read found, as if its wait had run out: its client asks again.

The process learns it from the signal itself: the first time the app is called (the server's
handlers are installed by then), ``install`` puts a handler in front of the server's own for
SIGTERM and SIGINT, which marks the process draining, wakes the loop's streams and waits, and
calls the server's handler as before. Only in front of a handler a server installed (a
callable): under the default action the process ends at once anyway.
"""

import asyncio
import signal
import threading
import weakref
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_draining = False
_installed = False
# What wakes the waits and streams of one event loop, run on that loop (``longpoll``, ``sse``).
_wakers: list[Callable[[], None]] = []
_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def draining() -> bool:
    """Tell whether the process is stopping: streams end and waits answer now."""
    return _draining


def on_drain(wake: Callable[[], None]) -> None:
    """Register ``wake``, called on each event loop that served a request once the process drains."""
    _wakers.append(wake)


def install() -> None:
    """Drain on SIGTERM / SIGINT, before the server's own handler (call it on the event loop; idempotent)."""
    global _installed
    _loops.add(asyncio.get_running_loop())
    if _installed or threading.current_thread() is not threading.main_thread():
        return  # signal handlers live on the main thread only
    _installed = True
    for sig in SIGNALS:
        previous = signal.getsignal(sig)
        if callable(previous):
            signal.signal(sig, _chained(previous))


def _chained(previous: Callable) -> Callable:
    def handler(signum: int, frame: object) -> None:
        begin()
        previous(signum, frame)

    return handler


def begin() -> None:
    """Mark the process draining and wake every loop's waits and streams (safe in a signal handler)."""
    global _draining
    _draining = True
    for loop in list(_loops):
        if not loop.is_closed():
            loop.call_soon_threadsafe(_wake_all)


def _wake_all() -> None:
    for wake in _wakers:
        wake()
