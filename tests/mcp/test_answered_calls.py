"""A session remembers its answered calls' undo for a late cancel: for a while, and a bounded number."""

import asyncio

from runstate._async.client import AsyncRunstate
from runstate.mcp import session as sessions


def session() -> sessions.Session:
    return sessions.Session(AsyncRunstate(base_url="http://127.0.0.1:9", api_key="k"), api_key="k")


def test_a_late_cancel_runs_the_answered_calls_undo_once():
    handed_back: list[int] = []

    async def main():
        s = session()

        async def undo(_: sessions.Session) -> None:
            handed_back.append(7)

        s.answered_call(7, undo)
        assert await s.cancelled_after_answer(7) is True
        assert await s.cancelled_after_answer(7) is False  # popped: a second cancel hands back nothing
        s.answered_call(8, undo)
        s.answering(8)  # a new call reuses the id: the late cancel names the new call, not the answered one
        assert await s.cancelled_after_answer(8) is False
        await s.rs.aclose()

    asyncio.run(main())
    assert handed_back == [7]


def test_answered_calls_are_forgotten_by_age_and_beyond_the_bound(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(sessions, "monotonic", lambda: clock[0])

    async def undo(_: sessions.Session) -> None:
        pass

    s = session()
    s.answered_call("old", undo)
    clock[0] += sessions.LATE_CANCEL_S
    s.answered_call("new", undo)
    assert list(s.answered) == ["new"]  # the old one passed its time
    for n in range(sessions.LATE_CANCEL_MAX + 10):
        s.answered_call(n, undo)
    assert len(s.answered) == sessions.LATE_CANCEL_MAX
    assert next(iter(s.answered)) == 10  # the oldest went first
    asyncio.run(s.rs.aclose())
