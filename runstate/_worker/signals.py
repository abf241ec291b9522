"""``SIGTERM`` stops every worker loop running on an event loop (task and message loops alike)."""

import asyncio
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

logger = logging.getLogger("runstate.worker")


class Stoppable(Protocol):
    """A worker loop that ``SIGTERM`` can stop (the task engine and the message engine)."""

    handle_signals: bool

    def stop(self) -> None: ...


# SIGTERM stops every worker running on a loop; the handler is installed by the first one
# and the previous disposition restored by the last one.
_sigterm_workers: dict[asyncio.AbstractEventLoop, set[Stoppable]] = {}
_sigterm_previous: dict[asyncio.AbstractEventLoop, Any] = {}


def _stop_all(loop: asyncio.AbstractEventLoop) -> None:
    logger.info("SIGTERM: stopping %d worker(s)", len(_sigterm_workers.get(loop, ())))
    for engine in list(_sigterm_workers.get(loop, ())):
        engine.stop()


@contextmanager
def _sigterm_stops(engine: Stoppable, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    if not engine.handle_signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    workers = _sigterm_workers.get(loop)
    if workers is None:
        previous = signal.getsignal(signal.SIGTERM)
        try:
            loop.add_signal_handler(signal.SIGTERM, _stop_all, loop)
        except (NotImplementedError, RuntimeError):  # no signal support on this loop/platform
            yield
            return
        workers = _sigterm_workers[loop] = set()
        _sigterm_previous[loop] = previous
    workers.add(engine)
    try:
        yield
    finally:
        workers.discard(engine)
        if not workers:
            del _sigterm_workers[loop]
            previous = _sigterm_previous.pop(loop)
            loop.remove_signal_handler(signal.SIGTERM)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
