"""Resources ``runstate://runs/{id}``, ``runstate://tasks/{id}``, ``runstate://groups/{id}``, and the prompt.

A resource reads the object as the API answers it (JSON). A client that subscribes to one
(``resources/subscribe``) gets ``notifications/resources/updated`` whenever the object
changes: the session follows the event log of the object's run from the moment of the
subscription (the cursor is taken before the subscription is answered, so no change after
it is missed) until ``resources/unsubscribe`` or the session's end.
"""

import asyncio
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError
from mcp_types import EmptyResult, SubscribeRequestParams, UnsubscribeRequestParams

from runstate._config import JsonDict
from runstate._errors import RunstateError
from runstate.mcp.session import Session

logger = logging.getLogger("runstate.mcp")

URI = re.compile(r"^runstate://(runs|tasks|groups)/([^/?#]+)$")
PAGE = 1000
RETRY_S = 1.0

SessionFor = Callable[[ServerRequestContext[Any, Any]], Session]

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


async def follow(session: Session, uri: str, kind: str, object_id: str, run_id: str, cursor: str | None) -> None:
    """Notify the client of ``uri`` at every event that changes the object, until cancelled."""
    send = session.send_resource_updated
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
        kind, object_id = parse(params.uri)
        session = session_for(request)
        if params.uri in session.watchers:
            return EmptyResult()
        try:
            data = await read(session, kind, object_id)
            run_id = {"runs": object_id, "tasks": data.get("runId"), "groups": data.get("scopeId")}[kind]
            cursor = await latest_cursor(session, str(run_id))
        except RunstateError as error:
            raise ResourceError(f"{error.code}: {error.message}") from error
        session.watchers[params.uri] = asyncio.get_running_loop().create_task(
            follow(session, params.uri, kind, object_id, str(run_id), cursor), name=f"runstate-watch {params.uri}"
        )
        return EmptyResult()

    async def unsubscribe(request: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams) -> EmptyResult:
        await session_for(request).unwatch(params.uri)
        return EmptyResult()

    # MCPServer has no decorator for these: they go on its low-level server, which advertises
    # the `resources.subscribe` capability once the handler is there.
    lowlevel = server._lowlevel_server
    lowlevel.add_request_handler("resources/subscribe", SubscribeRequestParams, subscribe)
    lowlevel.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, unsubscribe)

    @server.prompt(name="swarm_worker", title="Work as a swarm worker")
    def swarm_worker(mailbox: str, runId: str) -> str:
        """Tell an agent the loop of a mailbox's worker: claim, work, heartbeat, complete; stop on cancellation."""
        return SWARM_WORKER.format(mailbox=mailbox, run_id=runId)
