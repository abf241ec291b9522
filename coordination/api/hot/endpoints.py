"""The endpoints the hot path serves: what each checks before its statement, and its answer.

Each endpoint names its DRF view (its route, permission, ``Allow`` header and serializer come
from there), checks what the view would check before it writes (``accepts``: anything it
cannot decide from the process caches sends the request to the view), builds its statement
with the service's own function (``coordination.services.claims``) and answers from the rows.
No rows: the view answers (the careful path), except for a claim that may wait
(``ClaimTasks``), which takes the careful path itself and parks on the view's watch.

Under tracing an endpoint serves only if it makes the spans its view makes (``traced``, with
``spans`` around the answer); the router leaves every traced request of another to its view.
"""

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError
from django.utils import timezone
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api import waits
from coordination.api.auth import Principal
from coordination.api.bodies import task_spec
from coordination.api.hot import db
from coordination.api.longpoll import claim_long_poll, shared_db
from coordination.api.presenters import (
    batch_tasks,
    present_claim,
    present_completed_batch,
    present_renewed_batch,
    present_submitted_batch,
    present_task,
)
from coordination.api.views import work
from coordination.domain.states import MailboxMode, TaskState
from coordination.models import Mailbox, Task
from coordination.plumbing import tracing
from coordination.plumbing.tracing import NO_TRACE, TraceContext
from coordination.reads import selectors
from coordination.reads.selectors import RunRef, Visibility
from coordination.services import dispatch, sql
from coordination.services import tasks as task_services
from coordination.services.claims import batches, operations
from coordination.services.claims.claim import Claim
from coordination.services.keys import CachedKey
from coordination.services.mailboxes import mailbox_cached

logger = logging.getLogger(__name__)

# ``hop(fn, *args)``: run ``fn`` in one request thread (ApiASGIHandler.in_thread).
Hop = Callable[..., Awaitable[Any]]


@dataclass
class Call:
    """One request the hot path serves: its key, route arguments, validated body and trace context.

    ``trace`` is the caller's context (the request's headers) until the endpoint's ``spans``
    open its view's span: then that span (``span``) and the context the work stores.
    """

    api_key: CachedKey  # the process cache's, shared: read, never changed
    kwargs: dict
    data: dict
    trace: TraceContext = NO_TRACE
    mailbox: Mailbox | None = None
    run_id: Any = None
    span: Any = None
    target: Any = None  # a wait's object id, parsed
    scope: dict | None = None  # the ASGI scope (a header the endpoint reads: the stream's ``Last-Event-ID``)
    run: RunRef | None = None  # the run a claim or submit names, from the process cache
    claiming: asyncio.Future | None = None  # a waiting claim's last attempt, run to its end (``ClaimTasks``)

    @property
    def project_id(self):
        """Return the caller's project id."""
        return self.api_key.project_id

    @property
    def visibility(self) -> Visibility:
        """Return what the caller's key can see."""
        return Principal(self.api_key).visibility


async def _task(statement: str, params: dict) -> Task | None:
    rows = sql.models_from_rows(Task, await db.fetch(statement, params))
    return rows[0][0] if rows else None


async def mailbox_name(task: Task, hop: Hop) -> str:
    """Return the name of ``task``'s mailbox: from the process cache, else read in one thread hop."""
    name = selectors.mailbox_name_cached(task.mailbox_id)
    if name is None:  # the first task of a mailbox this process answers: one read
        name = (await hop(selectors.mailbox_names, [task]))[task.mailbox_id]
    return name


async def _task_answer(statement_and_params: tuple[str, dict], hop: Hop, *, may_requeue: bool) -> Response | None:
    """Run a statement on one claim; return the task's API shape, or None (no row: the careful path)."""
    task = await _task(*statement_and_params)
    if task is None:
        return None
    if may_requeue and task.state == TaskState.QUEUED and dispatch.waker() is not None:
        # As the services do after their statement: a task back in the queue wakes a Celery
        # worker of a bound mailbox (a broker message; rare, so in a thread).
        await hop(dispatch.work_requeued, task)
    return Response(present_task(task, await mailbox_name(task, hop)))


def _cached_mailbox_and_run(call: Call) -> bool:
    """Find the WORK mailbox and the run a request names in the process caches; False when either is not there."""
    call.mailbox = mailbox_cached(project_id=call.project_id, name=call.kwargs["name"])
    if call.mailbox is None or call.mailbox.mode != MailboxMode.WORK:
        return False
    try:
        run = selectors.run_ref(call.visibility, call.data["runId"], cached_only=True)
    except Exception:  # noqa: BLE001 - not found, malformed: the view answers it
        return False
    if run is None:
        return False
    call.run, call.run_id = run, run.id
    return True


class Endpoint:
    """A hot endpoint: its DRF view, method and body serializer, its checks, its statement and answer.

    ``waits``: the answer may wait (``coordination/api/hot/waits.py``): the client going
    away cancels it, and its query string, not its body, is validated (by ``serializer``).
    """

    view: type
    serializer: type | None
    # Whether it makes the spans its view makes (``spans``): in a process that traces, the
    # router leaves every request of an endpoint that does not to its view.
    traced = False
    method = "POST"
    waits = False
    # The ``Accept`` headers it serves (the view answers any other: its negotiation decides).
    media = frozenset({b"", b"*/*", b"application/json"})

    def accepts(self, call: Call) -> bool:
        """Tell whether the hot path can answer ``call`` as the view would (else the view answers)."""
        return True

    def parks(self, call: Call) -> bool:
        """Tell whether ``call``'s answer may wait: the client going away then cancels it (``abandon`` after)."""
        return self.waits

    async def abandon(self, call: Call) -> None:
        """Give back what ``call``'s answer took though it was never sent (its client left; nothing here)."""

    def spans(self, call: Call) -> AbstractContextManager:
        """Open the view's own spans for ``call``, around the answer and the view's if it answers (none here).

        A statement's span is the psycopg instrumentation's, on either path.
        """
        return nullcontext()

    async def answer(self, call: Call, hop: Hop) -> Response | None:
        """Run the statement; return the view's answer, or None when the careful path (the view) must answer."""
        raise NotImplementedError


class Complete(Endpoint):
    """``POST /v1/claims/{id}/complete``."""

    view, serializer = work.ClaimCompleteView, s.CompleteIn
    traced = True

    async def answer(self, call, hop):  # noqa: D102
        statement = operations.complete_statement(
            project_id=call.project_id, claim_id=call.kwargs["claim_id"], outcome=call.data["outcome"]
        )
        return await _task_answer(statement, hop, may_requeue=False)


class Fail(Endpoint):
    """``POST /v1/claims/{id}/fail``."""

    view, serializer = work.ClaimFailView, s.FailIn
    traced = True

    async def answer(self, call, hop):  # noqa: D102
        data = call.data
        statement = operations.fail_statement(
            project_id=call.project_id,
            claim_id=call.kwargs["claim_id"],
            error=data["error"],
            retry=data["retry"],
            retry_delay_ms=data["retryDelayMs"],
        )
        return await _task_answer(statement, hop, may_requeue=True)


class Release(Endpoint):
    """``POST /v1/claims/{id}/release`` (its view reads no body)."""

    view, serializer = work.ClaimReleaseView, None
    traced = True

    async def answer(self, call, hop):  # noqa: D102
        statement = operations.release_statement(project_id=call.project_id, claim_id=call.kwargs["claim_id"])
        return await _task_answer(statement, hop, may_requeue=True)


class Renew(Endpoint):
    """``POST /v1/claims/{id}/renew``."""

    view, serializer = work.ClaimRenewView, s.RenewIn
    traced = True

    async def answer(self, call, hop):  # noqa: D102
        statement, params = operations.renew_statement(
            project_id=call.project_id, claim_id=call.kwargs["claim_id"], lease_ttl_ms=call.data.get("leaseTtlMs")
        )
        task = await _task(statement, params)
        if task is None:
            return None
        claim = Claim(task, task.attempts, task.lease_expires_at)
        return Response(present_claim(claim, await mailbox_name(task, hop)))


class ClaimTasks(Endpoint):
    """``POST /v1/mailboxes/{name}/claims``: a claim at once, or one that waits parked on the event loop.

    Without a wait the statement answers, or the view (it claimed nothing). A claim that may
    wait (``waitMs`` above 0) takes its place among the key's waits, as the view's
    ``hold_wait``, runs the statement once (work queued: answered), then claims as the view's
    ``longpoll.claim_long_poll`` does, on the same
    watch of rounds (the view's share key and topics): each claim is the statement on the hot
    pool and, when that claims nothing, the careful path in one thread hop (a takeover due, an
    inactive run's refusal: ``task_claim(after_statement=True)``). Parked, it holds no thread
    and no connection. In a process that traces, a claim that may wait is its view's.

    A claim in flight when the client leaves runs to its end (``call.claiming``, shielded
    from the cancel) and ``abandon`` hands back what it claimed (``claim_release``): a claim
    committed while its client was leaving goes back to the queue at once.
    """

    view, serializer = work.ClaimCollectionView, s.ClaimIn
    traced = True

    def accepts(self, call):  # noqa: D102
        return not (self.parks(call) and tracing.tracing_on()) and _cached_mailbox_and_run(call)

    def parks(self, call):  # noqa: D102
        return call.data["waitMs"] > 0

    async def answer(self, call, hop):  # noqa: D102
        if not self.parks(call):
            claims = await self._claimed(call)
            if not claims:  # nothing to claim, or a takeover due, or an inactive run: the careful path
                return None
        else:
            place = waits.wait_take(api_key_id=call.api_key.id)
            try:
                # The statement alone first: a queue with work answers without a watch to join
                # and leave. Claiming nothing, the claim joins the watch (subscribed before its
                # next claim, so a submit after that claim still wakes it) and claims again.
                claims = await self._attempt(call, None)
                if not claims:
                    claims = await claim_long_poll(
                        None,
                        topics=call.run.chain_ids,
                        timeout_ms=s.clamp_wait_ms(call.data["waitMs"]),
                        share=("claim", call.project_id, call.mailbox.id, call.run_id),  # the view's watch
                        on_loop=lambda first: self._attempt(call, hop if first else shared_db),
                    )
            finally:
                place.release()
        return Response({"claims": [present_claim(claim, call.mailbox.name) for claim in claims]})

    @staticmethod
    def _claiming(call: Call) -> dict:
        """Return the claim's arguments to ``claim_statement`` and ``task_claim``."""
        data = call.data
        return {
            "project_id": call.project_id,
            "mailbox": call.mailbox,
            "run_id": call.run_id,
            "worker_id": data["workerId"],
            "lease_ttl_ms": data.get("leaseTtlMs"),
            "max_claims": data["max"],
        }

    async def _claimed(self, call: Call) -> list[Claim]:
        """Run the claim statement on the hot pool; return its claims."""
        statement, params = operations.claim_statement(**self._claiming(call))
        rows = sql.models_from_rows(Task, await db.fetch(statement, params))
        return operations.claims_from_rows(rows, call.mailbox, params["lease_until"])

    async def _attempt(self, call: Call, hop: Hop | None) -> list[Claim]:
        """Claim once (the statement, then the careful path in ``hop``), run to its end if the client leaves.

        ``hop`` None: the statement alone (nothing claimed when the pool has no connection ready).
        """

        async def claim() -> list[Claim]:
            try:
                claims = await self._claimed(call)
            except db.NoConnection:  # the server down or the pool busy: the service's own path decides
                claims, after_statement = [], False
            else:
                after_statement = True
            if claims or hop is None:
                return claims
            return await hop(
                functools.partial(operations.task_claim, **self._claiming(call), after_statement=after_statement)
            )

        call.claiming = asyncio.ensure_future(claim())
        return await asyncio.shield(call.claiming)

    async def abandon(self, call):  # noqa: D102 - the last attempt's claims go back to the queue
        if call.claiming is None:
            return
        try:
            claims = await call.claiming
        except Exception:  # noqa: BLE001 - a refusal or an outage: it claimed nothing
            return
        for claim in claims:
            try:
                await shared_db(operations.claim_release, project_id=call.project_id, claim_id=claim.claim_id)
            except Exception:  # noqa: BLE001 - taken over or ended meanwhile; its lease runs out otherwise
                logger.warning("claim %s of a client that left not released", claim.claim_id, exc_info=True)


@contextmanager
def _send_span(call: Call) -> Iterator[None]:
    """Open a submit's ``send`` span as its view does; the tasks store its context (``call.trace``)."""
    with tracing.send_span(call.mailbox.name, call.trace, run_id=call.run_id) as (call.span, call.trace):
        yield


class Submit(Endpoint):
    """``POST /v1/mailboxes/{name}/tasks``."""

    view, serializer = work.TaskSubmitView, s.TaskSubmitIn
    traced = True

    def accepts(self, call):  # noqa: D102
        return _cached_mailbox_and_run(call)

    def spans(self, call):  # noqa: D102
        return _send_span(call)

    async def answer(self, call, hop):  # noqa: D102
        data, mailbox, now = call.data, call.mailbox, timezone.now()
        spec = task_spec(data)
        task, wake = task_services.submit_prepared(
            project_id=call.project_id, mailbox=mailbox, run_id=call.run_id, spec=spec, now=now, trace=call.trace
        )
        rows = await db.fetch(*task_services.submit_statement(task, mailbox, now))
        if not task_services.submitted(task, rows):  # a key used before, a gate, an inactive run
            return None
        tracing.annotate(call.span, task_id=task.id, group_id=task.group_id)
        if wake is not None:  # a mailbox bound to a Celery task: its message, as the service sends it
            await hop(wake)
        return Response(present_task(task, mailbox.name), status=201, headers={"Location": f"/v1/tasks/{task.id}"})


async def _mailbox_names(tasks: list[Task], hop: Hop) -> dict:
    names = {task.mailbox_id: selectors.mailbox_name_cached(task.mailbox_id) for task in tasks}
    if None in names.values():  # a mailbox this process has not named yet: one read
        names = await hop(selectors.mailbox_names, tasks)
    return names


async def _claim_batch(batch: batches.ClaimBatch, call: Call, hop: Hop) -> list[tuple[str, object]] | None:
    """Run a checked claim batch's statement; answer ``(claimId, answer)`` per item, or None (the view answers).

    A statement that decided no item leaves the whole batch to the view. Items it left
    undecided after deciding others (committed already) take the service's careful path,
    each in its own transaction, in one thread hop (``ClaimBatch.finish``).
    """
    params = batch.params(timezone.now())
    if params is not None:
        rows = sql.models_from_rows(Task, await db.fetch(batch.statement, params))
        if not rows:
            return None
        batch.take([task for (task,) in rows])
    answers = await hop(batch.finish) if batch.undecided else batch.finish()
    return [(item["claimId"], answer) for item, answer in zip(call.data["items"], answers, strict=True)]


class CompleteMany(Endpoint):
    """``POST /v1/claims/complete``: a batch (its view's per-item answer, ``presenters.present_completed_batch``)."""

    view, serializer = work.ClaimBatchCompleteView, s.ClaimsCompleteIn
    traced = True

    async def answer(self, call, hop):  # noqa: D102
        batch = batches.complete_batch(
            project_id=call.project_id, items=[(item["claimId"], item["outcome"]) for item in call.data["items"]]
        )
        answers = await _claim_batch(batch, call, hop)
        if answers is None:
            return None
        return Response(present_completed_batch(answers, await _mailbox_names(batch_tasks(answers), hop)))


class RenewMany(Endpoint):
    """``POST /v1/claims/renew``: a batch (its view's per-item answer, ``presenters.present_renewed_batch``)."""

    view, serializer = work.ClaimBatchRenewView, s.ClaimsRenewIn
    traced = True

    async def answer(self, call, hop):  # noqa: D102
        batch = batches.renew_batch(
            project_id=call.project_id,
            items=[(item["claimId"], item.get("leaseTtlMs")) for item in call.data["items"]],
        )
        answers = await _claim_batch(batch, call, hop)
        if answers is None:
            return None
        return Response(present_renewed_batch(answers, await _mailbox_names(batch_tasks(answers), hop)))


class SubmitMany(Endpoint):
    """``POST /v1/mailboxes/{name}/tasks/batch``: every task in one statement, or the view answers."""

    view, serializer = work.TaskBatchSubmitView, s.TaskBatchIn
    traced = True

    def accepts(self, call):  # noqa: D102
        return _cached_mailbox_and_run(call)

    def spans(self, call):  # noqa: D102
        return _send_span(call)

    async def answer(self, call, hop):  # noqa: D102
        mailbox, now = call.mailbox, timezone.now()
        tasks, wakes = task_services.submit_many_prepared(
            project_id=call.project_id,
            mailbox=mailbox,
            run_id=call.run_id,
            items=[task_spec(item) for item in call.data["tasks"]],
            now=now,
            label="tasks",
            trace=call.trace,
        )
        try:
            rows = await db.fetch(*task_services.submit_many_statement(tasks, mailbox, now))
        except IntegrityError:  # a key taken by a concurrent submit: the statement wrote nothing
            return None
        if not task_services.submitted_many(tasks, rows):  # a key used before, a gate, an inactive run
            return None
        tracing.annotate(call.span, batch_size=len(tasks))
        if any(wake is not None for wake in wakes):  # a mailbox bound to a Celery task: one message
            await hop(dispatch.work_wakes_send, wakes)
        body, status = present_submitted_batch([(task, True) for task in tasks], mailbox.name)
        return Response(body, status=status)


ENDPOINTS: dict[type, Endpoint] = {
    endpoint.view: endpoint
    for endpoint in (
        Complete(),
        Fail(),
        Release(),
        Renew(),
        ClaimTasks(),
        Submit(),
        CompleteMany(),
        RenewMany(),
        SubmitMany(),
    )
}
