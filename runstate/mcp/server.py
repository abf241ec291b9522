"""The MCP server definition: one ``MCPServer`` whose tools call runstate through the async SDK.

Each tool answers a ``CallToolResult`` built here: structured content (the API's camelCase
objects) plus the same as JSON text. A refused call is a result with ``isError`` and
``{error: {code, message, details, nextStep}}`` (``runstate.mcp.refusals``), never a protocol
error. Every answer of a session that holds claims carries ``cancellation``: held tasks whose
cancellation was requested or whose run stopped.
"""

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from time import monotonic
from typing import Annotated, Any, Literal

import anyio
from mcp.server.context import CallNext, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.dispatcher import coerce_request_id
from mcp.shared.jsonrpc_dispatcher import cancelled_request_id_from_params
from mcp_types import CallToolResult, RequestId, TextContent, ToolAnnotations
from pydantic import Field

from runstate._async.client import AsyncRunstate
from runstate._async.work import AsyncClaim
from runstate._config import JsonDict
from runstate._errors import AuthenticationError, RunstateError, ScopeInactiveError, TransportError
from runstate.mcp import coordination, resources
from runstate.mcp.common import (
    CHANGE,
    CREATE,
    DESTROY,
    READ,
    Answer,
    ClaimId,
    Doer,
    Mailbox,
    RunId,
    TimeoutMs,
    Undoer,
    wrap,
)
from runstate.mcp.refusals import refusal_body
from runstate.mcp.session import ClaimCall, Session, held_view

SESSION_STATE_KEY = "runstate.session"
PROGRESS_EVERY_S = 1.0
logger = logging.getLogger("runstate.mcp")

INSTRUCTIONS = """\
runstate coordinates a swarm of workers and agents. Take work with task_claim (mailbox and run),
do it, call task_heartbeat when you like (its answer says whether to stop), and end every claim
with task_complete, task_fail or task_release. Claims are renewed for you while this session
lives. Whenever an answer carries a non-empty `cancellation` list, stop the work it names and
call task_complete for it. A refused call answers isError with error.code and error.nextStep:
follow nextStep."""


class ServerConfig:
    """Where runstate is, and whose key a session uses (``api_key`` None: each request's bearer key)."""

    def __init__(self, base_url: str | None, api_key: str | None, *, keys_from_requests: bool) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.keys_from_requests = keys_from_requests


def _bearer(headers: Mapping[str, str] | None) -> str:
    value = (headers or {}).get("authorization") or ""
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthenticationError(
            "Send the runstate API key as `Authorization: Bearer <key>`.", code="UNAUTHENTICATED", status_code=401
        )
    return key.strip()


def session_of(request: ServerRequestContext[Any, Any], config: ServerConfig) -> Session:
    """Return the session's runstate state, made on its first call; ended with the MCP connection."""
    # The per-connection state and teardown of mcp 2.x (``Connection.state`` / ``exit_stack``):
    # one connection is one MCP session on stdio and on streamable HTTP alike.
    connection = request.session._connection
    session: Session | None = connection.state.get(SESSION_STATE_KEY)
    key = _bearer(getattr(request.request, "headers", None)) if config.keys_from_requests else config.api_key
    if session is None:
        session = Session(AsyncRunstate(base_url=config.base_url, api_key=key), api_key=key)
        session.send_resource_updated = connection.send_resource_updated
        connection.state[SESSION_STATE_KEY] = session
        connection.exit_stack.push_async_callback(session.close)
    elif session.api_key != key:
        raise AuthenticationError(
            "A session keeps the API key it started with: open a new session for another key.",
            code="UNAUTHENTICATED",
            status_code=401,
        )
    return session


def _request_key(request_id: RequestId | None) -> int | str | None:
    """Return the request id as the dispatcher correlates it ("7" and 7 are one id)."""
    return None if request_id is None else coerce_request_id(request_id)


def _result(body: JsonDict, *, error: bool = False) -> CallToolResult:
    text = json.dumps(body, default=str)
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=body, is_error=error)


async def _report_progress(ctx: Context, wait_ms: int) -> None:
    """Send a progress notification every ``PROGRESS_EVERY_S`` of a wait (a no-op without a progressToken)."""
    started = monotonic()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        waited_ms = int((monotonic() - started) * 1000)
        try:
            await ctx.report_progress(waited_ms, wait_ms, f"waited {waited_ms} of {wait_ms} ms")
        except Exception:  # noqa: BLE001 - progress is a courtesy: a closed stream must not end the wait
            logger.debug("progress notification not sent", exc_info=True)
            return


def build_server(config: ServerConfig) -> MCPServer:
    """Return the runstate MCP server (every tool registered), for stdio or streamable HTTP."""
    server = MCPServer("runstate", instructions=INSTRUCTIONS)

    async def answer(
        ctx: Context,
        do: Doer,
        *,
        fresh: Callable[[], frozenset[str]] | None = None,
        undo: Undoer | None = None,
        wait_ms: int | None = None,
    ) -> CallToolResult:
        """Run ``do`` for the session and answer its result, a refusal, or ``cancellation`` news.

        ``fresh``: held claims just taken (no need to renew them for the news). ``undo``: what
        to hand back when the call is cancelled (``notifications/cancelled``) after taking
        something, so nothing leaks. ``wait_ms``: the call waits; report progress meanwhile.
        """
        try:
            session = session_of(ctx.request_context, config)
        except RunstateError as error:
            return _result(refusal_body(error), error=True)
        request_id = _request_key(ctx.request_context.request_id)
        if request_id is not None:
            session.answering(request_id)
        try:
            result = await _answer(ctx, session, do, fresh, wait_ms)
        except anyio.get_cancelled_exc_class():
            if undo is not None:
                with anyio.CancelScope(shield=True):
                    await undo(session)
            raise
        if undo is not None and request_id is not None:  # its cancel may cross the answer: see late_cancel
            session.answered_call(request_id, undo)
        return result

    async def _answer(
        ctx: Context, session: Session, do: Doer, fresh: Callable[[], frozenset[str]] | None, wait_ms: int | None
    ) -> CallToolResult:
        failed = False
        ticker = asyncio.create_task(_report_progress(ctx, wait_ms)) if wait_ms else None
        try:
            body = await do(session)
        except TransportError as error:
            error.code = "TRANSPORT_ERROR"
            body, failed = refusal_body(error), True
        except RunstateError as error:
            body, failed = refusal_body(error), True
        except TimeoutError as error:
            body, failed = refusal_body(RunstateError(str(error), code="TIMEOUT")), True
        finally:
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
        if session.holds_anything():
            try:
                await session.refresh(fresh=fresh() if fresh else frozenset())
            except RunstateError:
                pass  # the background renewer keeps trying; the answer says what is known
            body["cancellation"] = session.cancellation()
        return _result(body, error=failed)

    async def late_cancel(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
        """Hand back what a call took when its ``notifications/cancelled`` arrives after its answer.

        The client sent the cancel before the answer reached it, so it drops the answer (as the
        protocol says it should): without this, claims the answer named would be held by nobody
        until their lease ran out. The dispatcher applies a cancel only to calls still running;
        one that crossed its answer reaches this middleware with the call already answered.
        """
        outcome = await call_next(ctx)
        if ctx.request_id is None and ctx.method == "notifications/cancelled":
            request_id = _request_key(cancelled_request_id_from_params(ctx.params))
            session: Session | None = ctx.session._connection.state.get(SESSION_STATE_KEY)
            if session is not None and request_id is not None:
                with anyio.CancelScope(shield=True):
                    if await session.cancelled_after_answer(request_id):
                        logger.info("call %s was cancelled after its answer: what it took is handed back", request_id)
        return outcome

    server.middleware.append(late_cancel)

    def tool(name: str, annotations: ToolAnnotations, title: str) -> Callable[[Any], Any]:
        return server.tool(name=name, title=title, annotations=annotations)

    # ---- runs -------------------------------------------------------------------------------

    @tool("run_create", CREATE, "Create a run")
    async def run_create(
        ctx: Context,
        name: Annotated[str | None, Field(description="A label for people; never a lookup key.")] = None,
        parentId: Annotated[str | None, Field(description="Create the run as a child of this run.")] = None,
        deadline: Annotated[
            str | None, Field(description="RFC 3339 UTC time after which the run refuses work.")
        ] = None,
    ) -> Answer:
        """Create a run: the scope that owns tasks, groups, barriers and timers, cancelled as one tree.

        Call it before submitting work. Two calls make two runs. Answers the run (its `id`).
        """

        async def do(s: Session) -> JsonDict:
            run = await s.rs.scopes.create(name=name, parent_id=parentId, deadline=deadline)
            return {"run": run.data}

        return await answer(ctx, do)

    @tool("run_status", READ, "Read a run")
    async def run_status(ctx: Context, runId: RunId) -> Answer:
        """Read a run and its direct children.

        `run.effective` is ACTIVE while work may go on, else INACTIVE with `inactiveReason`
        (CANCELLED, COMPLETED, DEADLINE_EXCEEDED). `childrenByState` counts the children per state.
        """

        async def do(s: Session) -> JsonDict:
            run = await s.rs.scope(runId).status()
            page = await s.rs.scopes.list(parent_id=runId, limit=1000)
            children = page["results"]
            counts: dict[str, int] = {}
            for child in children:
                state = child.get("storedState", "?")
                counts[state] = counts.get(state, 0) + 1
            return {"run": run, "children": children, "childrenByState": counts}

        return await answer(ctx, do)

    @tool("run_cancel", DESTROY, "Cancel a run")
    async def run_cancel(
        ctx: Context,
        runId: RunId,
        reason: Annotated[str | None, Field(description="Why, recorded on the run.")] = None,
    ) -> Answer:
        """Cancel a run and everything below it, at once and for good.

        Its unfinished tasks become CANCELLED, its groups fail, its barriers and timers are
        cancelled; workers holding its claims are told to stop. Repeating it changes nothing.
        """
        return await answer(ctx, lambda s: wrap("run", s.rs.scope(runId).cancel(reason)))

    @tool("run_complete", DESTROY, "Complete a run")
    async def run_complete(ctx: Context, runId: RunId) -> Answer:
        """Mark a run completed, for good: it and its subtree refuse new work and unfinished tasks are cancelled.

        Call it when the run's goal is reached. Repeating it changes nothing.
        """
        return await answer(ctx, lambda s: wrap("run", s.rs.scope(runId).complete()))

    # ---- work -------------------------------------------------------------------------------

    @tool("mailbox_ensure", CHANGE, "Ensure a mailbox")
    async def mailbox_ensure(
        ctx: Context,
        name: Annotated[str, Field(description="The mailbox's name.")],
        mode: Annotated[Literal["WORK", "QUEUE"], Field(description="WORK holds tasks; QUEUE holds messages.")],
        leaseTtlMs: Annotated[int | None, Field(ge=1000, description="A claim's lease (default 30 s).")] = None,
        maxAttempts: Annotated[
            int | None, Field(ge=1, description="Claims per task before it fails (default 3).")
        ] = None,
    ) -> Answer:
        """Make sure a mailbox exists before submitting to it (idempotent; needs the resource_config permission).

        Answers the `mailbox`. MAILBOX_MODE_CONFLICT when it exists with the other mode.
        """

        async def do(s: Session) -> JsonDict:
            mailbox = await s.rs.mailboxes.ensure(name, mode=mode, lease_ttl_ms=leaseTtlMs, max_attempts=maxAttempts)
            return {"mailbox": mailbox}

        return await answer(ctx, do)

    @tool("task_submit", CREATE, "Submit tasks")
    async def task_submit(
        ctx: Context,
        mailbox: Mailbox,
        runId: RunId,
        input: Annotated[Any, Field(description="The task's input (any JSON); ignored when `tasks` is given.")] = None,
        key: Annotated[
            str | None, Field(description="Makes the submit idempotent: the same key and input answer the same task.")
        ] = None,
        priority: Annotated[int | None, Field(description="Higher is claimed first.")] = None,
        tasks: Annotated[
            list[dict[str, Any]] | None,
            Field(description="Submit many at once: items {input, key?, priority?}; all or nothing."),
        ] = None,
    ) -> Answer:
        """Submit one task (`input`) or many (`tasks`) to a WORK mailbox under a run, for workers to claim.

        Answers `tasks`: each with its `id` and `state` (QUEUED). Wait for one with task_result.
        """

        async def do(s: Session) -> JsonDict:
            work = s.rs.scope(runId).tasks
            if tasks is not None:
                items = [
                    {"input": item.get("input"), "key": item.get("key"), "priority": item.get("priority")}
                    for item in tasks
                ]
                tickets = await work.submit_many(mailbox, items)  # type: ignore[arg-type]
            else:
                tickets = [await work.submit(mailbox, input, key=key, priority=priority)]
            return {"tasks": [ticket.data for ticket in tickets]}

        return await answer(ctx, do)

    @tool("task_claim", CREATE, "Claim a task")
    async def task_claim(
        ctx: Context,
        mailbox: Mailbox,
        runId: RunId,
        waitMs: Annotated[
            int, Field(ge=0, le=30_000, description="Wait up to this long for a task (30 s at most).")
        ] = 0,
        leaseTtlMs: Annotated[
            int | None, Field(ge=1000, description="The lease's length; the mailbox's default otherwise.")
        ] = None,
        max: Annotated[int, Field(ge=1, le=100, description="Claim up to this many tasks.")] = 1,
    ) -> Answer:
        """Take the next task(s) of a run from a WORK mailbox, to work on them yourself.

        Answers `claims` (empty when none came within `waitMs`): each has `claimId`, `attempt` and
        `task` (its `input`). This session renews the lease for you until you call task_complete,
        task_fail or task_release; if the session ends first, the task is taken over by another worker.
        """
        got: list[AsyncClaim] = []
        lost: list[ClaimCall] = []  # the request in flight, until its answer arrives

        async def do(s: Session) -> JsonDict:
            call = s.claim_call(runId)
            lost.append(call)
            try:
                claims = await s.rs.scope(runId).tasks.claim(
                    mailbox, max=max, wait_ms=waitMs, lease_ttl_ms=leaseTtlMs, worker_id=call.worker_id
                )
            except TransportError:  # the answer was lost: what the service may have committed goes back
                await s.release_lost_claims(call)
                lost.clear()
                raise
            lost.clear()
            got.extend(claims)
            for claim in claims:
                await s.hold(claim, leaseTtlMs)
            return {"claims": [claim.data for claim in claims]}

        async def undo(s: Session) -> None:  # cancelled: hand back what was taken, answered or not
            for claim in got:
                await s.release_hold(claim.id)
                with contextlib.suppress(RunstateError):
                    await claim.release()
            for call in lost:  # cancelled in flight: found by the call's workerId in the claim events
                await s.release_lost_claims(call)

        return await answer(ctx, do, fresh=lambda: frozenset(claim.id for claim in got), undo=undo, wait_ms=waitMs)

    @tool("task_heartbeat", CHANGE, "Check in on a claim")
    async def task_heartbeat(ctx: Context, claimId: ClaimId) -> Answer:
        """Renew a claim's lease now and learn whether to stop.

        Leases are renewed for you; call this between steps of long work. `cancellationRequested`
        true means stop and call task_complete (the task is then recorded CANCELLED).
        """

        async def do(s: Session) -> JsonDict:
            held = s.held.get(claimId)
            try:
                data = await s.claim(claimId).renew()
            except ScopeInactiveError as error:
                if held is None:
                    raise
                held.refused_code = error.code
                return {"claimId": claimId, "cancellationRequested": True, "reason": error.code}
            view = {"claimId": claimId, "cancellationRequested": bool(data.get("cancellationRequested"))}
            if held is not None:
                view |= held_view(held)
            return view | {"leaseExpiresAt": data.get("leaseExpiresAt")}

        return await answer(ctx, do)

    @tool("task_complete", CHANGE, "Complete a task")
    async def task_complete(
        ctx: Context,
        claimId: ClaimId,
        outcome: Annotated[Any, Field(description="The task's result (any JSON).")] = None,
    ) -> Answer:
        """Record the claimed task's outcome and end the claim.

        The task ends SUCCEEDED, or CANCELLED when its cancellation was requested (also when its
        run was cancelled meanwhile). Answers the `task`.
        """

        async def do(s: Session) -> JsonDict:
            async with s.settling(claimId, "complete") as held:
                claim = held.claim if held is not None else s.claim(claimId)
                try:
                    return {"task": await claim.complete(outcome)}
                except ScopeInactiveError:
                    if held is None:
                        raise
                    # The run stopped under the claim: the service already recorded the task CANCELLED.
                    task = await s.rs.tasks.get(claim.task_id).status()
                    if task.get("state") != "CANCELLED":
                        raise
                    return {"task": task}

        return await answer(ctx, do)

    @tool("task_fail", CHANGE, "Fail a task")
    async def task_fail(
        ctx: Context,
        claimId: ClaimId,
        error: Annotated[Any, Field(description="What went wrong (any JSON).")] = None,
        retry: Annotated[bool, Field(description="Queue the task again while it has attempts left.")] = False,
    ) -> Answer:
        """Record that the claimed task failed and end the claim; with `retry` it goes back to the queue.

        Answers the `task` (QUEUED again, or FAILED).
        """

        async def do(s: Session) -> JsonDict:
            async with s.settling(claimId, "fail", failure=f"task_fail: {json.dumps(error, default=str)[:500]}"):
                return {"task": await s.claim(claimId).fail(error, retry=retry)}

        return await answer(ctx, do)

    @tool("task_release", CHANGE, "Release a task")
    async def task_release(ctx: Context, claimId: ClaimId) -> Answer:
        """Hand the claimed task back to the queue untouched, for another worker; ends the claim."""

        async def do(s: Session) -> JsonDict:
            await s.release_hold(claimId)
            return {"task": await s.claim(claimId).release()}

        return await answer(ctx, do)

    @tool("task_result", READ, "Wait for a task's result")
    async def task_result(
        ctx: Context,
        taskId: Annotated[str, Field(description="The task's id.")],
        timeoutMs: TimeoutMs = 30_000,
    ) -> Answer:
        """Wait until the task is finished and answer it: `state` (SUCCEEDED, FAILED, CANCELLED, EXPIRED) and `outcome`.

        Answers TIMEOUT when it is still running after `timeoutMs`: call again to keep waiting.
        """
        return await answer(
            ctx, lambda s: wrap("task", s.rs.tasks.get(taskId).result(timeout_ms=timeoutMs)), wait_ms=timeoutMs
        )

    # ---- groups -----------------------------------------------------------------------------

    @tool("group_create", CREATE, "Create a quorum group")
    async def group_create(
        ctx: Context,
        mailbox: Mailbox,
        condition: Annotated[
            Literal["FIRST_ACCEPTED", "N_ACCEPTED", "ALL_TERMINAL"],
            Field(description="When the group succeeds: one accepted member, `threshold` accepted, or all finished."),
        ],
        threshold: Annotated[int | None, Field(ge=1, le=100, description="For N_ACCEPTED only.")] = None,
        expectedMembers: Annotated[
            int | None, Field(ge=1, le=100, description="The group closes when this many members joined.")
        ] = None,
        parentScopeId: Annotated[str | None, Field(description="Make the group's own run a child of this run.")] = None,
        name: Annotated[str | None, Field(description="A label.")] = None,
    ) -> Answer:
        """Create a group of tasks decided by verdicts (accept or reject), in a WORK mailbox.

        Its members run under the group's own run (`scopeId`: claim them with that run id). When
        the group is decided, its unfinished members are cancelled. Answers the `group`.
        """

        async def do(s: Session) -> JsonDict:
            group = await s.rs.groups.create(
                mailbox=mailbox,
                condition=condition,
                threshold=threshold,
                expected_members=expectedMembers,
                parent_scope_id=parentScopeId,
                name=name,
            )
            return {"group": group.data}

        return await answer(ctx, do)

    GroupId = Annotated[str, Field(description="The group's id.")]

    @tool("group_submit", CREATE, "Submit a group member")
    async def group_submit(
        ctx: Context,
        groupId: GroupId,
        input: Annotated[Any, Field(description="The member task's input (any JSON).")] = None,
        key: Annotated[str | None, Field(description="Makes the submit idempotent.")] = None,
    ) -> Answer:
        """Add a member task to an open group; workers claim it under the group's `scopeId`. Answers the `task`."""

        async def do(s: Session) -> JsonDict:
            ticket = await s.rs.groups.by_id(groupId).submit(input, key=key)
            return {"task": ticket.data}

        return await answer(ctx, do)

    @tool("group_close", CHANGE, "Close a group")
    async def group_close(ctx: Context, groupId: GroupId) -> Answer:
        """Close the group to new members; it is decided once its members are.

        Answers `{state, outcome, outcomeReason}`.
        """
        return await answer(ctx, lambda s: wrap("group", s.rs.groups.by_id(groupId).close()))

    @tool("group_verdict", CHANGE, "Record a verdict")
    async def group_verdict(
        ctx: Context,
        groupId: GroupId,
        taskId: Annotated[str, Field(description="The member task's id.")],
        verdict: Annotated[Literal["accept", "reject"], Field(description="accept (a SUCCEEDED member) or reject.")],
    ) -> Answer:
        """Accept or reject a finished member; the group is decided as soon as the verdicts decide it.

        Answers `{taskId, verdict, late, groupState, outcome, outcomeReason}`.
        """

        async def do(s: Session) -> JsonDict:
            group = s.rs.groups.by_id(groupId)
            return {"verdict": await (group.accept(taskId) if verdict == "accept" else group.reject(taskId))}

        return await answer(ctx, do)

    @tool("group_wait", READ, "Wait for a group's decision")
    async def group_wait(ctx: Context, groupId: GroupId, timeoutMs: TimeoutMs = 30_000) -> Answer:
        """Wait until the group is decided (FINALIZED); answer it with `outcome` (SUCCESS or FAILURE) and members.

        Answers TIMEOUT when undecided after `timeoutMs`: call again to keep waiting.
        """
        return await answer(
            ctx, lambda s: wrap("group", s.rs.groups.by_id(groupId).wait(timeout_ms=timeoutMs)), wait_ms=timeoutMs
        )

    coordination.register(tool, answer)
    resources.register(server, lambda request: session_of(request, config))
    return server


def stdio_config() -> ServerConfig:
    """Return the stdio server's configuration: ``RUNSTATE_URL`` and ``RUNSTATE_API_KEY``."""
    return ServerConfig(os.environ.get("RUNSTATE_URL"), os.environ.get("RUNSTATE_API_KEY"), keys_from_requests=False)


def run_stdio() -> None:
    """Serve one session on stdin/stdout until the client closes it."""
    from runstate.mcp import stdio

    stdio.run(build_server(stdio_config()))


def run_http(host: str, port: int) -> None:
    """Serve streamable HTTP at ``/mcp``: each session forwards its own bearer key; the server holds none.

    DNS-rebinding protection is on: only Host and Origin headers naming the bound address are accepted.
    """
    from mcp.server.transport_security import TransportSecuritySettings

    config = ServerConfig(os.environ.get("RUNSTATE_URL"), None, keys_from_requests=True)
    hosts = [host, f"{host}:{port}"]
    if host in ("127.0.0.1", "localhost"):
        hosts += [f"localhost:{port}", "localhost", f"127.0.0.1:{port}"]
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=sorted(set(hosts)),
        allowed_origins=sorted({f"http://{h}" for h in hosts}),
    )
    build_server(config).run("streamable-http", host=host, port=port, transport_security=security)
