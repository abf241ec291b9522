"""``/v1/runs``: create, list, status, children, cancel, complete."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.presenters import present_run
from coordination.api.views.base import ApiView, with_errors
from coordination.domain.states import Permission
from coordination.reads import selectors
from coordination.services import runs as run_services


def _present(run):
    return present_run(run, selectors.runs_effective([run])[run.id])


def _created(run):
    return Response(_present(run), status=201, headers={"Location": f"/v1/runs/{run.id}"})


class RunCollectionView(ApiView):
    """Create runs and list them."""

    required_permissions = {"GET": Permission.COORDINATION_READ, "POST": Permission.COORDINATION_WRITE}

    @extend_schema(
        operation_id="runs_list",
        parameters=[s.RunListQuery],
        responses=with_errors({200: s.RunPageOut}),
    )
    def get(self, request):
        """List runs oldest first, optionally the children of ``parentId`` or one ``state``."""
        query = self.query(s.RunListQuery)
        page = selectors.run_list(
            self.visibility,
            parent_id=query.get("parentId"),
            state=query.get("state"),
            cursor=query.get("cursor"),
            limit=query["limit"],
        )
        effective = selectors.runs_effective(page.items)
        return Response(
            {"results": [present_run(run, effective[run.id]) for run in page.items], "nextCursor": page.next_cursor}
        )

    @extend_schema(operation_id="runs_create", request=s.RunCreateIn, responses=with_errors({201: s.RunOut}))
    def post(self, request):
        """Create a run: a root run, or a child of ``parentId``."""
        data = self.body(s.RunCreateIn)
        parent_id = None
        if data.get("parentId") is not None:
            parent_id = selectors.run_get(self.visibility, data["parentId"]).id
        else:
            self.visibility.require_project_wide("A key bound to a run creates runs only below that run.")
        run = run_services.run_create(
            project_id=self.project_id,
            parent_id=parent_id,
            name=data["name"],
            deadline=data["deadline"],
            child_limit=data.get("childLimit"),
        )
        return _created(run)


class RunDetailView(ApiView):
    """A run's status."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="runs_retrieve", responses=with_errors({200: s.RunOut}))
    def get(self, request, run_id):
        """Return the run with its effective state."""
        return Response(_present(selectors.run_get(self.visibility, run_id)))


class RunChildrenView(ApiView):
    """Create a child run."""

    @extend_schema(operation_id="runs_children_create", request=s.RunChildIn, responses=with_errors({201: s.RunOut}))
    def post(self, request, run_id):
        """Create a child of the run."""
        data = self.body(s.RunChildIn)
        parent = selectors.run_get(self.visibility, run_id)
        run = run_services.run_create(
            project_id=self.project_id,
            parent_id=parent.id,
            name=data["name"],
            deadline=data["deadline"],
            child_limit=data.get("childLimit"),
        )
        return _created(run)


class RunCancelView(ApiView):
    """Cancel a run and its subtree."""

    @extend_schema(operation_id="runs_cancel", request=s.RunCancelIn, responses=with_errors({200: s.RunOut}))
    def post(self, request, run_id):
        """Cancel the run: its whole subtree refuses new work and its unfinished work ends."""
        data = self.body(s.RunCancelIn)
        run = selectors.run_get(self.visibility, run_id)
        run = run_services.run_cancel(
            run_id=run.id, project_id=self.project_id, reason=data.get("reason") or None, trace=self.caller_trace()
        )
        return Response(_present(run))


class RunCompleteView(ApiView):
    """Complete a run and its subtree."""

    @extend_schema(operation_id="runs_complete", request=None, responses=with_errors({200: s.RunOut}))
    def post(self, request, run_id):
        """Complete the run: like cancel, but recorded as a normal finish."""
        run = selectors.run_get(self.visibility, run_id)
        run = run_services.run_complete(run_id=run.id, project_id=self.project_id, trace=self.caller_trace())
        return Response(_present(run))
