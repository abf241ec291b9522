"""``/v1/groups``: task groups decided exactly once."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.longpoll import Answer, Watched, long_poll
from coordination.api.presenters import present_decision, present_group, present_task
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain.states import GroupState, Permission, Verdict
from coordination.plumbing import tracing
from coordination.reads import selectors
from coordination.reads.selectors import Visibility
from coordination.services import groups as group_services


def fresh_group(visibility, group_id):
    """Read a group; one past its deadline (or with an inactive gate) is finalized first."""
    group = selectors.group_get(visibility, group_id)
    if selectors.group_is_due(group):
        group_services.group_finalize_if_due(group_id=group.id)
        group = selectors.group_get(visibility, group_id)
    return group


class GroupCollectionView(ApiView):
    """Create a group."""

    @extend_schema(operation_id="groups_create", request=s.GroupCreateIn, responses=with_errors({201: s.GroupOut}))
    def post(self, request):
        """Create a group and its gate run (a child of ``parentScopeId`` when given)."""
        data = self.body(s.GroupCreateIn)
        parent_id = None
        if data.get("parentScopeId") is not None:
            parent_id = selectors.run_get(self.visibility, data["parentScopeId"]).id
        else:
            self.visibility.require_project_wide("A key bound to a run creates groups only below that run.")
        group = group_services.group_create(
            project_id=self.project_id,
            mailbox_name=data["mailbox"],
            condition=data["condition"],
            threshold=data.get("threshold"),
            expected_members=data.get("expectedMembers"),
            deadline=data["deadline"],
            parent_scope_id=parent_id,
            name=data["name"],
        )
        return Response(present_group(group), status=201, headers={"Location": f"/v1/groups/{group.id}"})


class GroupDetailView(ApiView):
    """A group's status with every member."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="groups_retrieve", responses=with_errors({200: s.GroupOut}))
    def get(self, request, group_id):
        """Return the group (finalizing it first if its deadline passed)."""
        return Response(present_group(fresh_group(self.visibility, group_id)))


class GroupWaitView(AsyncApiView):
    """Long-poll a group's decision."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="groups_wait", parameters=[s.WaitQuery], responses=with_errors({200: s.GroupOut}))
    async def get(self, request, group_id):
        """Answer once the group is finalized, or with its current state after ``timeoutMs`` (max 30 s)."""
        query = self.query(s.WaitQuery)
        self.hold_wait(query["timeoutMs"])
        watched = group_watched(self.visibility, selectors.parse_id(group_id, what="Group"))
        _, answer = await long_poll(**watched._asdict(), timeout_ms=s.clamp_wait_ms(query["timeoutMs"]))
        return self.shared_answer(answer, wait="group")


def group_watched(visibility: Visibility, ref) -> Watched:
    """Return what a wait on a group watches (its view and the hot path): the group, finalized when due."""

    def read():
        group = fresh_group(visibility, ref)
        return group, Answer(present_group(group))

    return Watched(read, lambda pair: pair[0].state == GroupState.FINALIZED, [ref], ("group", ref, visibility))


def _member_response(task, group, created):
    body = {**present_task(task), "groupState": group.state}
    if created:
        return Response(body, status=201, headers={"Location": f"/v1/tasks/{task.id}"})
    return Response(body)


class GroupMemberSubmitView(ApiView):
    """Submit a member."""

    @extend_schema(
        operation_id="groups_members_submit",
        request=s.GroupMemberSubmitIn,
        responses=with_errors(
            {201: s.MemberTaskOut, 200: OpenApiResponse(s.MemberTaskOut, description="idempotent resubmit")}
        ),
    )
    def post(self, request, group_id):
        """Submit a member; ``groupState`` tells whether this submit closed the group."""
        data = self.body(s.GroupMemberSubmitIn)
        group = selectors.group_get(self.visibility, group_id)
        with tracing.send_span(group.mailbox.name, self.caller_trace(), run_id=group.scope_id) as (span, trace):
            task, created, group = group_services.group_submit(
                project_id=self.project_id, group_id=group.id, input=data["input"], key=data["key"], trace=trace
            )
            tracing.annotate(span, task_id=task.id, group_id=group.id)
        return _member_response(task, group, created)


class GroupJoinView(ApiView):
    """Join an existing task to the group."""

    @extend_schema(operation_id="groups_join", request=s.GroupJoinIn, responses=with_errors({200: s.MemberTaskOut}))
    def post(self, request, group_id):
        """Add a task of the same project and mailbox while the group is open."""
        data = self.body(s.GroupJoinIn)
        group = selectors.group_get(self.visibility, group_id)
        task = selectors.task_get(self.visibility, data["taskId"])
        task, group = group_services.group_join(project_id=self.project_id, group_id=group.id, task_id=task.id)
        return _member_response(task, group, created=False)


class GroupCloseView(ApiView):
    """Close a group (idempotent)."""

    seal = False

    @extend_schema(operation_id="groups_close", request=None, responses=with_errors({200: s.GroupDecisionOut}))
    def post(self, request, group_id):
        """Close the group to new members and evaluate it at once."""
        group = selectors.group_get(self.visibility, group_id)
        group = group_services.group_close(project_id=self.project_id, group_id=group.id, seal=self.seal)
        return Response(present_decision(group))


class GroupSealView(GroupCloseView):
    """Seal a group: close, but ``GROUP_FINALIZED`` if it is already finalized."""

    seal = True

    @extend_schema(operation_id="groups_seal", request=None, responses=with_errors({200: s.GroupDecisionOut}))
    def post(self, request, group_id):
        """Close the group; a finalized group is a 409 ``GROUP_FINALIZED``."""
        return super().post(request, group_id)


class MemberVerdictView(ApiView):
    """Accept or reject a member."""

    verdict = Verdict.ACCEPTED

    def post(self, request, group_id, task_id):
        """Record the verdict; after finalize it is kept as ``late`` and changes nothing."""
        group = selectors.group_get(self.visibility, group_id)
        result = group_services.group_verdict(
            project_id=self.project_id,
            group_id=group.id,
            task_id=selectors.parse_id(task_id, what="Task"),
            verdict=self.verdict,
        )
        member, group = result.member, result.group
        return Response(
            {
                "taskId": str(member.task_id),
                "verdict": member.verdict,
                "late": member.late,
                "groupState": group.state,
                "outcome": group.outcome,
                "outcomeReason": group.outcome_reason,
            }
        )


class MemberAcceptView(MemberVerdictView):
    """Accept a succeeded member."""

    verdict = Verdict.ACCEPTED

    @extend_schema(operation_id="groups_members_accept", request=None, responses=with_errors({200: s.VerdictOut}))
    def post(self, request, group_id, task_id):
        """Accept the member (its task must have ``SUCCEEDED``)."""
        return super().post(request, group_id, task_id)


class MemberRejectView(MemberVerdictView):
    """Reject a finished member."""

    verdict = Verdict.REJECTED

    @extend_schema(operation_id="groups_members_reject", request=None, responses=with_errors({200: s.VerdictOut}))
    def post(self, request, group_id, task_id):
        """Reject the member (its task must be finished)."""
        return super().post(request, group_id, task_id)
