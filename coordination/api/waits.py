"""How many long-polls and event streams each API key holds open in this process, capped.

A wait holds no thread and no database connection, but it holds memory, a socket and a
place in the watches; one key opening them by the thousand could crowd out every other key
of the process. ``RUNSTATE_MAX_WAITS_PER_KEY`` (default 1000; 0 turns the cap off) caps them
per key **per API process**: with several processes a key may hold that many in each. A wait
beyond the cap is answered ``429 RATE_LIMITED`` at once, before the request does anything.

Only a request that waits takes a place: a long-poll with ``waitMs`` / ``timeoutMs`` above 0,
and every event stream. A long-poll's place is given back when its view returns, however it
returns (an answer, an error, the client gone: ``AsyncApiView.dispatch``); a stream's when
the stream ends, however it ends.
"""

import threading
import uuid
from collections import Counter

from django.conf import settings

from coordination.domain import exceptions
from coordination.plumbing import metrics

_lock = threading.Lock()  # the in-process test client runs views on loops of several threads
_held: Counter[uuid.UUID] = Counter()


class Place:
    """One wait of one key; ``release`` gives it back (once, however often it is called)."""

    def __init__(self, api_key_id: uuid.UUID) -> None:
        self.api_key_id = api_key_id
        self.released = False

    def release(self) -> None:
        """Give the place back."""
        with _lock:
            if self.released:
                return
            self.released = True
            metrics.WAITS_HELD.dec()
            _held[self.api_key_id] -= 1
            if _held[self.api_key_id] <= 0:
                del _held[self.api_key_id]


def wait_take(*, api_key_id: uuid.UUID) -> Place:
    """Take a place for a wait of ``api_key_id``; ``RATE_LIMITED`` if the key holds the most it may."""
    cap = settings.RUNSTATE_MAX_WAITS_PER_KEY
    with _lock:
        if cap > 0 and _held[api_key_id] >= cap:
            raise exceptions.RateLimited(
                f"This API key already holds {cap} waits in this process; wait for one to end.",
                maxWaitsPerKey=cap,
            )
        _held[api_key_id] += 1
        metrics.WAITS_HELD.inc()
    return Place(api_key_id)


def waits_held(*, api_key_id: uuid.UUID) -> int:
    """Return how many waits ``api_key_id`` holds in this process (tests look)."""
    with _lock:
        return _held[api_key_id]
