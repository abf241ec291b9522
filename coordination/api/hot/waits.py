"""The waits the hot path serves: a task's result, a group, a barrier, a timer, and the event long-poll.

``GET /v1/tasks/{id}/result``, ``GET /v1/groups/{id}/wait``, ``GET /v1/barriers/{id}/wait``
and ``POST /v1/timers/{id}/wait``; and ``GET /v1/events`` (``EventList``: a page of the log
by ``event_list``'s own query, each waiter on a watch of its own, as with its view). Each
takes what its view takes before it waits: the query (``?timeoutMs=`` / ``?waitMs=``, checked
by its serializer's fields) and a place among its key's waits (``waits.wait_take``: ``429``
beyond ``RUNSTATE_MAX_WAITS_PER_KEY``). Its first read is one statement on the hot pool
(``selectors.row_statement``, ``selectors.GROUP_WAIT_SQL``, ``selectors.event_list_query``);
an object already decided is answered at once. Otherwise the request waits on the *watch*
its view's waiters use (``longpoll.long_poll`` with the view's own ``Watched``: the same
share key, so the view's waiters and the hot path's of one object share one subscription,
one re-read per wake-up and one rendering), parked on the event loop with no thread and no
connection. Its answer is the rendering kept on the read's ``Answer``
(``views.base.shared_response``): the same bytes as every other waiter the read answers.

The view answers (in one thread hop, the request counted already) what the first read
cannot answer as the view would without writing: no row (an unknown id, another project's
object), a group due to be finalized (past its deadline, or its gate inactive), a timer that
has fired or is due (acknowledging it is a write) or was cancelled.
"""

from django.utils import timezone
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api import waits
from coordination.api.hot import db
from coordination.api.hot.endpoints import Call, Endpoint, Hop, mailbox_name
from coordination.api.longpoll import Answer, Watched, long_poll
from coordination.api.presenters import present_barrier, present_group, present_task, present_timer
from coordination.api.views import clock, events, groups, work
from coordination.api.views.base import shared_response
from coordination.domain import exceptions
from coordination.domain.states import TimerState
from coordination.models import Barrier, Event, Task, Timer
from coordination.reads import selectors
from coordination.services import sql

_renderer = JSONRenderer()


class _Careful(Exception):
    """The first read found what only the view answers as it would: the view answers the request."""


class Wait(Endpoint):
    """A wait: its query, its place among the key's waits, its first read, its watch and its shared answer."""

    serializer = s.WaitQuery
    method = "GET"
    waits = True
    wait_field = "timeoutMs"  # the query's field saying how long it may wait
    model: type  # the object waited on
    wait: str  # its label in ``runstate_wait_answers_rendered_total``
    argument: str  # the route's argument naming it

    def accepts(self, call: Call) -> bool:  # noqa: D102 - a malformed id: the view's ``NotFound``
        try:
            call.target = selectors.parse_id(call.kwargs[self.argument])
        except exceptions.NotFound:
            return False
        return True

    def watched(self, call: Call) -> Watched:
        """Return what the view's waiters of the object watch."""
        raise NotImplementedError

    async def first(self, call: Call, hop: Hop, sent) -> tuple[object, Answer]:
        """Read the object in one statement; return ``(object, Answer)`` as the view's read would, else ``_Careful``.

        ``sent``: for ``db.fetch`` (waiters joining before it is called share this read).
        """
        statement, params = selectors.row_statement(self.model, project_id=call.project_id, object_id=call.target)
        rows = await db.fetch(statement, params, sent=sent)
        if not rows:
            raise _Careful()
        found = sql.models_from_rows(self.model, rows)[0][0]
        return found, Answer(await self.present(found, hop))

    async def present(self, found, hop: Hop) -> dict:
        """Return the API shape of the object read."""
        raise NotImplementedError

    def check(self, found) -> None:
        """Raise the view's refusal of a finished wait's object, if any."""

    async def answer(self, call, hop):  # noqa: D102
        timeout_ms = call.data[self.wait_field]
        place = waits.wait_take(api_key_id=call.api_key.id) if timeout_ms > 0 else None
        try:
            value = await long_poll(
                **self.watched(call)._asdict(),
                timeout_ms=s.clamp_wait_ms(timeout_ms),
                first=lambda sent: self.first(call, hop, sent),
            )
        except _Careful:
            return None
        finally:
            if place is not None:
                place.release()
        return self.respond(call, value)

    def respond(self, call: Call, value) -> object:
        """Answer with the read's ``Answer``, rendered once for every waiter it answers (after the view's check)."""
        found, answer = value
        self.check(found)
        return shared_response(
            answer, wait=self.wait, status=200, renderer=_renderer, media_type=_renderer.media_type, context={}
        )


class TaskResult(Wait):
    """``GET /v1/tasks/{id}/result``."""

    view, model, wait, argument = work.TaskResultView, Task, "task", "task_id"

    def watched(self, call):  # noqa: D102
        return work.task_result_watched(call.visibility, call.target)

    async def present(self, found, hop):  # noqa: D102
        return present_task(found, await mailbox_name(found, hop))


class GroupWait(Wait):
    """``GET /v1/groups/{id}/wait``."""

    view, wait, argument = groups.GroupWaitView, "group", "group_id"

    def watched(self, call):  # noqa: D102
        return groups.group_watched(call.visibility, call.target)

    async def first(self, call, hop, sent):  # noqa: D102
        now = timezone.now()
        params = {"project_id": call.project_id, "id": call.target, "now": now}
        rows = await db.fetch(selectors.GROUP_WAIT_SQL, params, sent=sent)
        if not rows:
            raise _Careful()
        group, gate_active, members = selectors.group_from_wait_row(rows[0])
        if selectors.group_is_due(group, now, gate_active=gate_active):
            raise _Careful()  # the view finalizes it first
        return group, Answer(present_group(group, members))


class BarrierWait(Wait):
    """``GET /v1/barriers/{id}/wait``."""

    view, model, wait, argument = clock.BarrierWaitView, Barrier, "barrier", "barrier_id"

    def watched(self, call):  # noqa: D102
        return clock.barrier_watched(call.visibility, call.target)

    async def present(self, found, hop):  # noqa: D102
        return present_barrier(found)

    def check(self, found):  # noqa: D102
        clock.barrier_refuse_cancelled(found)


class TimerWait(Wait):
    """``POST /v1/timers/{id}/wait``: the view acknowledges a fired timer; an armed or acknowledged one is only read."""

    view, model, wait, argument = clock.TimerWaitView, Timer, "timer", "timer_id"
    method = "POST"

    def watched(self, call):  # noqa: D102
        return clock.timer_watched(call.visibility, call.target)

    async def first(self, call, hop, sent):  # noqa: D102
        timer, answer = await super().first(call, hop, sent)
        unchanged = timer.state == TimerState.ACKNOWLEDGED or (
            timer.state == TimerState.ARMED and timer.fire_at > timezone.now()
        )
        if not unchanged:  # fired, due or cancelled: ``timer_acknowledge`` writes or refuses
            raise _Careful()
        return timer, answer

    async def present(self, found, hop):  # noqa: D102
        return present_timer(found)


class EventList(Wait):
    """``GET /v1/events``, which may wait (``waitMs``): a page of the event log, each waiter on a watch of its own."""

    view, serializer, wait_field = events.EventListView, s.EventListQuery, "waitMs"

    def accepts(self, call):  # noqa: D102 - a run the process has not seen, or cannot show: the view
        if call.data.get("runId") is None:
            return True
        try:
            run = selectors.run_ref(call.visibility, call.data["runId"], cached_only=True)
        except exceptions.NotFound:
            return False
        call.target = None if run is None else run.path
        return run is not None

    def watched(self, call):  # noqa: D102
        return events.event_page_watched(call.visibility, call.data)

    async def first(self, call, hop, sent):  # noqa: D102
        query = call.data
        horizon = await _event_horizon(sent)
        page = selectors.event_list_query(
            call.visibility,
            after=query.get("after"),
            types=events.event_page_types(query),
            run_path=call.target,
            limit=query["limit"],
            horizon=horizon,
        )
        statement, params = page.query.sql_with_params()
        found = [event for (event,) in sql.models_from_rows(Event, await db.fetch(statement, params))]
        return found, selectors.event_page_cursor(found, query.get("after"))

    def respond(self, call, value):  # noqa: D102
        return Response(events.present_page(call.visibility, *value))


async def _event_horizon(sent) -> int:
    """Read the event horizon on the pool as ``selectors.event_horizon`` does; ``sent`` goes with the first read."""
    for attempt in range(selectors.EVENT_HORIZON_TRIES):
        [(horizon, ended)] = await db.fetch(selectors.EVENT_HORIZON_NOW_SQL, {}, sent=None if attempt else sent)
        if not ended:
            break
    return horizon


ENDPOINTS: dict[type, Endpoint] = {
    endpoint.view: endpoint for endpoint in (TaskResult(), GroupWait(), BarrierWait(), TimerWait(), EventList())
}
