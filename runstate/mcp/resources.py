"""Resources ``runstate://runs/{id}``, ``runstate://tasks/{id}``, ``runstate://groups/{id}``, and the prompt.

A resource reads the object as the API answers it (JSON). A client that subscribes to one
gets ``notifications/resources/updated`` whenever the object changes: the session follows
the event log of the object's run from the moment of the subscription (the cursor is taken
before the subscription is answered, so no change after it is missed). Two protocols:

- up to 2025-11-25, ``resources/subscribe`` until ``resources/unsubscribe`` or the session's end;
- from 2026-07-28, a ``subscriptions/listen`` stream naming the URIs in its filter, for as long
  as the stream is open. Each stream has a bus of its own, fed only by its own watchers: an
  update never reaches another session, whose key may not read the object.
"""

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourceUpdated
from mcp_types import (
    EmptyResult,
    SubscribeRequestParams,
    SubscriptionsListenRequestParams,
    SubscriptionsListenResult,
    UnsubscribeRequestParams,
)

from runstate._config import JsonDict
from runstate._errors import RunstateError
from runstate.mcp.session import Session

logger = logging.getLogger("runstate.mcp")

URI = re.compile(r"^runstate://(runs|tasks|groups)/([^/?#]+)$")
PAGE = 1000
RETRY_S = 1.0

SessionFor = Callable[[ServerRequestContext[Any, Any]], Session]
Notify = Callable[[str], Awaitable[None]]

SWARM_WORKER = """\
You are a worker of a runstate swarm: take tasks from the mailbox `{mailbox}` of run `{run_id}` and do them.

Loop until task_claim answers no claims twice in a row, or the run is cancelled:
1. Call task_claim with mailbox "{mailbox}", runId "{run_id}" and waitMs 20000.
2. For each claim, do what its task's `input` asks. Your lease is renewed for you while you work.
3. Between steps of long work, call task_heartbeat with the claimId: if `cancellationRequested` is
   true, stop at once and go to step 4 with what you have.
4. Call task_complete with the claimId and your result as `outcome`; if you cannot do the task,
   call task_fail with an `error` (and `retry: true` if another attempt could succeed).

Whenever any answer carries a non-empty `cancellation` list, stop the work it names and call
task_complete for it. Whenever an answer has isError, follow its `error.nextStep`. Never leave a
claim without task_complete, task_fail or task_release."""


def parse(uri: str) -> tuple[str, str]:
    """Return ``(kind, id)`` of a runstate resource URI; ``ResourceError`` for anything else."""
    match = URI.match(uri)
    if match is None:
        raise ResourceError(f"Not a runstate resource: {uri} (runstate://runs|tasks|groups/ID).")
    return match.group(1), match.group(2)


async def read(session: Session, kind: str, object_id: str) -> JsonDict:
    """Read the object behind a resource URI."""
    rs = session.rs
    if kind == "runs":
        return await rs.scope(object_id).status()
    if kind == "tasks":
        return await rs.tasks.get(object_id).status()
    return await rs.groups.by_id(object_id).status()


def changes(kind: str, object_id: str, event: JsonDict) -> bool:
    """Tell whether ``event`` changed the object."""
    if event.get("subjectId") == object_id:
        return kind != "runs" or str(event.get("type", "")).startswith("run.")
    return kind == "groups" and (event.get("data") or {}).get("groupId") == object_id


async def latest_cursor(session: Session, run_id: str) -> str | None:
    """Page to the end of the run's events and return the cursor after the last one."""
    cursor: str | None = None
    while True:
        page = await session.rs.events.list(after=cursor, run_id=run_id, limit=PAGE)
        cursor = str(page["nextCursor"])
        if len(page["events"]) < PAGE:
            return cursor


async def watch(session: Session, uri: str, notify: Notify | None) -> "asyncio.Task[None]":
    """Start following ``uri``'s object for the session, from now: ``notify(uri)`` at every change.

    Answers once the cursor is taken (a change after it is never missed); ``ResourceError``
    when the object cannot be read with the session's key.
    """
    kind, object_id = parse(uri)
    try:
        data = await read(session, kind, object_id)
        run_id = {"runs": object_id, "tasks": data.get("runId"), "groups": data.get("scopeId")}[kind]
        cursor = await latest_cursor(session, str(run_id))
    except RunstateError as error:
        raise ResourceError(f"{error.code}: {error.message}") from error
    return asyncio.get_running_loop().create_task(
        follow(session, uri, kind, object_id, str(run_id), cursor, notify), name=f"runstate-watch {uri}"
    )


async def follow(
    session: Session, uri: str, kind: str, object_id: str, run_id: str, cursor: str | None, send: Notify | None
) -> None:
    """Notify the client of ``uri`` at every event that changes the object, until cancelled."""
    while True:
        try:
            page = await session.rs.events.list(after=cursor, run_id=run_id, limit=PAGE, wait_ms=30_000)
        except RunstateError as error:  # the server is away, or the key lost its access: try again later
            logger.warning("resource %s: events not read (%s); retrying", uri, error)
            await asyncio.sleep(RETRY_S)
            continue
        cursor = page["nextCursor"]
        if send is not None and any(changes(kind, object_id, event) for event in page["events"]):
            await send(uri)


def register(server: MCPServer, session_for: SessionFor) -> None:
    """Register the resource templates, their subscriptions and the ``swarm_worker`` prompt."""

    async def resource(ctx: Context, kind: str, object_id: str) -> str:
        try:
            return json.dumps(await read(session_for(ctx.request_context), kind, object_id))
        except RunstateError as error:
            raise ResourceError(f"{error.code}: {error.message}") from error

    @server.resource(
        "runstate://runs/{run_id}", name="run", mime_type="application/json", description="A run (as run_status)."
    )
    async def run_resource(run_id: str, ctx: Context) -> str:
        return await resource(ctx, "runs", run_id)

    @server.resource("runstate://tasks/{task_id}", name="task", mime_type="application/json", description="A task.")
    async def task_resource(task_id: str, ctx: Context) -> str:
        return await resource(ctx, "tasks", task_id)

    @server.resource("runstate://groups/{group_id}", name="group", mime_type="application/json", description="A group.")
    async def group_resource(group_id: str, ctx: Context) -> str:
        return await resource(ctx, "groups", group_id)

    async def subscribe(request: ServerRequestContext[Any, Any], params: SubscribeRequestParams) -> EmptyResult:
        session = session_for(request)
        if params.uri not in session.watchers:
            session.watchers[params.uri] = await watch(session, params.uri, session.send_resource_updated)
        return EmptyResult()

    async def unsubscribe(request: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams) -> EmptyResult:
        await session_for(request).unwatch(params.uri)
        return EmptyResult()

    async def listen(
        request: ServerRequestContext[Any, Any], params: SubscriptionsListenRequestParams
    ) -> SubscriptionsListenResult:
        """Serve one ``subscriptions/listen`` stream: its resource URIs watched while it is open.

        A URI that is not a runstate object the session can read is honored and never fires,
        as the protocol has it for a resource that does not exist.
        """
        session = session_for(request)
        bus = InMemorySubscriptionBus()  # this stream's own: nobody else's updates, nor ours to others

        async def notify(uri: str) -> None:
            await bus.publish(ResourceUpdated(uri=uri))

        watchers: list[asyncio.Task[None]] = []
        try:
            for uri in dict.fromkeys(params.notifications.resource_subscriptions or ()):
                try:
                    watchers.append(await watch(session, uri, notify))
                except ResourceError as error:
                    logger.info("listen: %s is not watched (%s)", uri, error)
            return await ListenHandler(bus)(request, params)
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    # MCPServer has no decorator for these: they go on its low-level server, which advertises
    # the `resources.subscribe` capability once the handler is there. The listen handler
    # replaces MCPServer's own, whose bus is shared by every session of the server.
    lowlevel = server._lowlevel_server
    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, unsubscribe)
    lowlevel.add_request_handler("subscriptions/listen", SubscriptionsListenRequestParams, listen)

    @server.prompt(name="swarm_worker", title="Work as a swarm worker")
    def swarm_worker(mailbox: str, runId: str) -> str:
        """Tell an agent the loop of a mailbox's worker: claim, work, heartbeat, complete; stop on cancellation."""
        return SWARM_WORKER.format(mailbox=mailbox, run_id=runId)
