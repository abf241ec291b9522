"""Mailboxes, tasks and claims: ``/v1/mailboxes/...``, ``/v1/tasks/...``, ``/v1/claims/...``."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.bodies import task_spec
from coordination.api.longpoll import Answer, Watched, claim_long_poll, in_request, long_poll
from coordination.api.presenters import (
    batch_tasks,
    present_claim,
    present_completed_batch,
    present_mailbox,
    present_renewed_batch,
    present_submitted_batch,
    present_task,
)
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain import exceptions
from coordination.domain.states import TASK_TERMINAL, MailboxMode, Permission
from coordination.plumbing import tracing
from coordination.reads import selectors
from coordination.reads.selectors import Visibility
from coordination.services import claims as claim_services
from coordination.services import tasks as task_services
from coordination.services.mailboxes import mailbox_ensure, mailbox_get
from coordination.services.reruns import task_rerun


class MailboxView(ApiView):
    """Ensure or read a mailbox."""

    required_permissions = {"GET": Permission.COORDINATION_READ, "PUT": Permission.RESOURCE_CONFIG}
    # A mailbox's settings hit every run that uses it; reading them stays open to a bound
    # worker, which needs the lease TTL (they are configuration, not anybody's usage).
    project_wide = frozenset({"PUT"})

    @extend_schema(
        operation_id="mailboxes_ensure",
        request=s.MailboxEnsureIn,
        responses=with_errors({200: s.MailboxOut, 201: s.MailboxOut}),
    )
    def put(self, request, name):
        """Ensure the mailbox exists with this mode: 201 when created, 200 when found.

        Refused to a key bound to a run (``PERMISSION_DENIED``).
        """
        data = self.body(s.MailboxEnsureIn)
        mailbox, created = mailbox_ensure(
            project_id=self.project_id,
            name=name,
            mode=data["mode"],
            lease_ttl_ms=data.get("leaseTtlMs"),
            max_attempts=data.get("maxAttempts"),
        )
        headers = {"Location": f"/v1/mailboxes/{mailbox.name}"} if created else {}
        return Response(present_mailbox(mailbox), status=201 if created else 200, headers=headers)

    @extend_schema(operation_id="mailboxes_retrieve", responses=with_errors({200: s.MailboxOut}))
    def get(self, request, name):
        """Return the mailbox."""
        return Response(present_mailbox(mailbox_get(project_id=self.project_id, name=name)))


class TaskSubmitView(ApiView):
    """Submit a task to a WORK mailbox."""

    @extend_schema(
        operation_id="tasks_submit",
        request=s.TaskSubmitIn,
        responses=with_errors({201: s.TaskOut, 200: OpenApiResponse(s.TaskOut, description="idempotent resubmit")}),
    )
    def post(self, request, name):
        """Submit a task under ``runId``; the same ``key`` and input answer the existing task (200)."""
        data = self.body(s.TaskSubmitIn)
        mailbox = mailbox_get(project_id=self.project_id, name=name, mode=MailboxMode.WORK)
        run = selectors.run_ref(self.visibility, data["runId"])
        with tracing.send_span(mailbox.name, self.caller_trace(), run_id=run.id) as (span, trace):
            task, created = task_services.task_submit(
                project_id=self.project_id,
                mailbox=mailbox,
                run_id=run.id,
                input=data["input"],
                key=data["key"],
                priority=data["priority"],
                max_attempts=data.get("maxAttempts"),
                expires_at=data["expiresAt"],
                trace=trace,
            )
            tracing.annotate(span, task_id=task.id, group_id=task.group_id)
        if not created:
            return Response(present_task(task, mailbox.name))
        return Response(present_task(task, mailbox.name), status=201, headers={"Location": f"/v1/tasks/{task.id}"})


class TaskBatchSubmitView(ApiView):
    """Submit many tasks to a WORK mailbox in one transaction."""

    batch_field = "tasks"  # the rate limit counts its items

    @extend_schema(
        operation_id="tasks_submit_batch",
        request=s.TaskBatchIn,
        responses=with_errors(
            {
                201: s.TasksOut,
                200: OpenApiResponse(s.TasksOut, description="every task was an idempotent resubmit"),
            }
        ),
    )
    def post(self, request, name):
        """Submit up to 1,000 tasks under ``runId``, all or none; answered in request order.

        201 when at least one task was created, 200 when every item was an idempotent resubmit
        (same ``key``, same input). One invalid item, or a ``key`` used before with another
        input, refuses the whole batch and writes nothing: ``details`` name the item
        (``tasks.<index>.<field>``, and ``index``). A run that refuses work refuses the batch.
        """
        data = self.body(s.TaskBatchIn)
        mailbox = mailbox_get(project_id=self.project_id, name=name, mode=MailboxMode.WORK)
        run = selectors.run_ref(self.visibility, data["runId"])
        with tracing.send_span(mailbox.name, self.caller_trace(), run_id=run.id) as (span, trace):
            answers = task_services.tasks_submit_many(
                project_id=self.project_id,
                mailbox=mailbox,
                run_id=run.id,
                label="tasks",
                items=[task_spec(item) for item in data["tasks"]],
                trace=trace,
            )
            tracing.annotate(span, batch_size=len(answers))
        body, status = present_submitted_batch(answers, mailbox.name)
        return Response(body, status=status)


class TaskDetailView(ApiView):
    """Read a task."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="tasks_retrieve", responses=with_errors({200: s.TaskOut}))
    def get(self, request, task_id):
        """Return the task."""
        return Response(present_task(selectors.task_get(self.visibility, task_id)))


class TaskResultView(AsyncApiView):
    """Long-poll a task until it is terminal."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="tasks_result", parameters=[s.WaitQuery], responses=with_errors({200: s.TaskOut}))
    async def get(self, request, task_id):
        """Answer once the task is terminal, or with its current state after ``timeoutMs`` (max 30 s)."""
        query = self.query(s.WaitQuery)
        self.hold_wait(query["timeoutMs"])
        watched = task_result_watched(self.visibility, selectors.parse_id(task_id, what="Task"))
        _, answer = await long_poll(**watched._asdict(), timeout_ms=s.clamp_wait_ms(query["timeoutMs"]))
        return self.shared_answer(answer, wait="task")


def task_result_watched(visibility: Visibility, ref) -> Watched:
    """Return what a wait on a task's result watches (its view and the hot path): the task until it is terminal."""

    def read():
        task = selectors.task_get(visibility, ref)
        return task, Answer(present_task(task))

    return Watched(read, lambda pair: pair[0].state in TASK_TERMINAL, [ref], ("task", ref, visibility))


class TaskCancelView(ApiView):
    """Cooperatively cancel one task."""

    @extend_schema(operation_id="tasks_cancel", request=s.TaskCancelIn, responses=with_errors({200: s.TaskOut}))
    def post(self, request, task_id):
        """Cancel a queued task at once, ask a running one to stop; a finished task is unchanged."""
        data = self.body(s.TaskCancelIn)
        task = selectors.task_get(self.visibility, task_id)
        task = task_services.task_cancel(
            project_id=self.project_id, task_id=task.id, reason=data.get("reason") or None, grace_ms=data.get("graceMs")
        )
        return Response(present_task(task))


class TaskRerunView(ApiView):
    """Rerun a finished task as a new task in the same mailbox and run."""

    @extend_schema(
        operation_id="tasks_rerun",
        request=s.TaskRerunIn,
        responses=with_errors({201: s.TaskOut, 200: OpenApiResponse(s.TaskOut, description="idempotent rerun")}),
    )
    def post(self, request, task_id):
        """Submit the task again, with its input unless ``input`` is given; the same ``key`` answers the rerun (200).

        The new task continues the old one's trace; a ``traceparent`` of another trace is linked.
        """
        data = self.body(s.TaskRerunIn)
        old = selectors.task_get(self.visibility, task_id)
        extra = {"input": data["input"]} if "input" in data else {}
        task, created = task_rerun(
            project_id=self.project_id, task_id=old.id, key=data["key"], trace=self.caller_trace(), **extra
        )
        if not created:
            return Response(present_task(task))
        return Response(present_task(task), status=201, headers={"Location": f"/v1/tasks/{task.id}"})


class ClaimCollectionView(AsyncApiView):
    """Claim tasks of exactly one run, optionally waiting for them."""

    @extend_schema(operation_id="claims_create", request=s.ClaimIn, responses=with_errors({200: s.ClaimsOut}))
    async def post(self, request, name):
        """Claim up to ``max`` tasks of ``runId``; with ``waitMs``, wait up to that long (max 30 s) for one."""
        data = self.body(s.ClaimIn)
        self.hold_wait(data["waitMs"])
        project_id, visibility = self.project_id, self.visibility

        def lookup():
            mailbox = mailbox_get(project_id=project_id, name=name, mode=MailboxMode.WORK)
            return mailbox, selectors.run_ref(visibility, data["runId"])

        mailbox, run = await in_request(lookup)

        def claim():
            return claim_services.task_claim(
                project_id=project_id,
                mailbox=mailbox,
                run_id=run.id,
                worker_id=data["workerId"],
                lease_ttl_ms=data.get("leaseTtlMs"),
                max_claims=data["max"],
            )

        claims = await claim_long_poll(
            claim,
            topics=run.chain_ids,
            timeout_ms=s.clamp_wait_ms(data["waitMs"]),
            share=("claim", project_id, mailbox.id, run.id),
        )
        return Response({"claims": [present_claim(c, mailbox.name) for c in claims]})


class ClaimView(ApiView):
    """An operation on a claim; a key bound to a run reaches only claims in its subtree."""

    def visible_claim_id(self, claim_id: str) -> str:
        """Return ``claim_id`` if the caller may see its task, else raise ``NotFound``."""
        if self.visibility.bound_path is not None:
            task_id, _ = claim_services.parse_claim_id(claim_id)
            try:
                selectors.task_get(self.visibility, task_id)
            except exceptions.NotFound:
                raise exceptions.NotFound("Claim not found.", claimId=claim_id) from None
        return claim_id


class ClaimBatchView(ClaimView):
    """A batch of claim operations: each item fenced and answered on its own, like SQS batch calls."""

    batch_field = "items"  # the rate limit counts its items

    def per_item(self, items: list[dict], call) -> list[tuple[str, object]]:
        """Answer each item: ``call`` on the visible ones (in one batch), ``NOT_FOUND`` for the rest."""
        answers: list[object] = [None] * len(items)
        visible = []
        for index, item in enumerate(items):
            try:
                visible.append((index, self.visible_claim_id(item["claimId"])))
            except exceptions.NotFound as error:
                answers[index] = error
        if visible:
            for (index, _), answer in zip(visible, call([items[i] for i, _ in visible]), strict=True):
                answers[index] = answer
        return [(item["claimId"], answer) for item, answer in zip(items, answers, strict=True)]


class ClaimBatchCompleteView(ClaimBatchView):
    """Complete many claims."""

    @extend_schema(
        operation_id="claims_complete_batch",
        request=s.ClaimsCompleteIn,
        responses=with_errors({200: s.ClaimsCompleteOut}),
    )
    def post(self, request):
        """Complete up to 500 claims; ``results`` answer each item in order, ``ok`` or its own error."""
        data = self.body(s.ClaimsCompleteIn)
        answers = self.per_item(
            data["items"],
            lambda items: claim_services.claims_complete_many(
                project_id=self.project_id, items=[(item["claimId"], item["outcome"]) for item in items]
            ),
        )
        return Response(present_completed_batch(answers, selectors.mailbox_names(batch_tasks(answers))))


class ClaimBatchRenewView(ClaimBatchView):
    """Renew many claims."""

    @extend_schema(
        operation_id="claims_renew_batch", request=s.ClaimsRenewIn, responses=with_errors({200: s.ClaimsRenewOut})
    )
    def post(self, request):
        """Renew up to 500 claims; ``results`` answer each item in order, ``ok`` or its own error."""
        data = self.body(s.ClaimsRenewIn)
        answers = self.per_item(
            data["items"],
            lambda items: claim_services.claims_renew_many(
                project_id=self.project_id, items=[(item["claimId"], item.get("leaseTtlMs")) for item in items]
            ),
        )
        return Response(present_renewed_batch(answers, selectors.mailbox_names(batch_tasks(answers))))


class ClaimRenewView(ClaimView):
    """Extend a claim's lease."""

    @extend_schema(operation_id="claims_renew", request=s.RenewIn, responses=with_errors({200: s.ClaimOut}))
    def post(self, request, claim_id):
        """Renew the lease; ``cancellationRequested`` tells the worker to stop."""
        data = self.body(s.RenewIn)
        claim = claim_services.claim_renew(
            project_id=self.project_id, claim_id=self.visible_claim_id(claim_id), lease_ttl_ms=data.get("leaseTtlMs")
        )
        return Response(present_claim(claim))


class ClaimCompleteView(ClaimView):
    """Complete a claimed task."""

    @extend_schema(operation_id="claims_complete", request=s.CompleteIn, responses=with_errors({200: s.TaskOut}))
    def post(self, request, claim_id):
        """Record the outcome (``CANCELLED`` instead if cancellation was requested)."""
        data = self.body(s.CompleteIn)
        task = claim_services.claim_complete(
            project_id=self.project_id, claim_id=self.visible_claim_id(claim_id), outcome=data["outcome"]
        )
        return Response(present_task(task))


class ClaimFailView(ClaimView):
    """Fail a claimed task."""

    @extend_schema(operation_id="claims_fail", request=s.FailIn, responses=with_errors({200: s.TaskOut}))
    def post(self, request, claim_id):
        """Record a failure; with ``retry`` the task is queued again while attempts remain."""
        data = self.body(s.FailIn)
        task = claim_services.claim_fail(
            project_id=self.project_id,
            claim_id=self.visible_claim_id(claim_id),
            error=data["error"],
            retry=data["retry"],
            retry_delay_ms=data["retryDelayMs"],
        )
        return Response(present_task(task))


class ClaimReleaseView(ClaimView):
    """Give a claimed task back."""

    @extend_schema(operation_id="claims_release", request=None, responses=with_errors({200: s.TaskOut}))
    def post(self, request, claim_id):
        """Put the task back in the queue (still allowed after the run was cancelled)."""
        task = claim_services.claim_release(project_id=self.project_id, claim_id=self.visible_claim_id(claim_id))
        return Response(present_task(task))
