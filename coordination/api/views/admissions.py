"""``/v1/runs/{id}/admission``, ``/v1/runs/{id}/admissions`` and ``/v1/admissions/{id}``."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination.api import admissions as a
from coordination.api import serializers as s
from coordination.api.longpoll import in_request, long_poll
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain.states import AdmissionState, Permission
from coordination.models import AdmissionConfig
from coordination.reads import selectors
from coordination.services import admissions as admission_services


class AdmissionConfigView(ApiView):
    """A run's admission limit: how many admitted children may be active at once."""

    required_permissions = {"GET": Permission.COORDINATION_READ, "PUT": Permission.RESOURCE_CONFIG}

    @extend_schema(operation_id="runs_admission_retrieve", responses=with_errors({200: a.AdmissionConfigOut}))
    def get(self, request, run_id):
        """Return the run's admission limit and use (``maxActive`` null when none is configured)."""
        run = selectors.run_get(self.visibility, run_id)
        config = AdmissionConfig.objects.filter(run_id=run.id).first()
        if config is None:
            config = AdmissionConfig(project_id=run.project_id, run=run, run_path=run.path, updated_at=run.created_at)
        return Response(a.present_admission_config(config))

    @extend_schema(
        operation_id="runs_admission_configure",
        request=a.AdmissionConfigIn,
        responses=with_errors({200: a.AdmissionConfigOut, 201: a.AdmissionConfigOut}),
    )
    def put(self, request, run_id):
        """Set ``maxActive`` (201 when the run had no limit, 200 when changed); a raise admits waiters at once."""
        data = self.body(a.AdmissionConfigIn)
        run = selectors.run_get(self.visibility, run_id)
        config, created = admission_services.admission_configure(
            project_id=self.project_id, run_id=run.id, max_active=data["maxActive"]
        )
        headers = {"Location": f"/v1/runs/{run.id}/admission"} if created else {}
        return Response(a.present_admission_config(config), status=201 if created else 200, headers=headers)


class AdmissionCollectionView(AsyncApiView):
    """Ask for room for a child run, optionally waiting in line for it."""

    @extend_schema(
        operation_id="runs_admissions_create",
        request=a.AdmissionRequestIn,
        responses=with_errors({200: a.AdmissionOut, 201: a.AdmissionOut}),
    )
    async def post(self, request, run_id):
        """Admit at once (201 with the new child run) or queue; with ``waitMs`` wait (max 30 s) in line.

        Admitted during the wait: 201. Still waiting at the end: 200, and the request stays in
        line (the same ``key`` picks it up again). The parent cancelled meanwhile: its code.
        """
        data = self.body(a.AdmissionRequestIn)
        self.hold_wait(data["waitMs"])
        project_id, visibility = self.project_id, self.visibility

        def ask():
            parent = selectors.run_get(visibility, run_id)
            return admission_services.admission_request(
                project_id=project_id, run_id=parent.id, name=data["name"], key=data["key"], deadline=data["deadline"]
            )

        answer = await in_request(ask)
        admission = answer.admission
        was_waiting = admission.state == AdmissionState.WAITING
        ref = admission.id

        def read():
            found = selectors.admission_get(visibility, ref)
            return found, a.present_admission(found), admission_services.admission_wait_refusal(found)

        found, body, refusal = await long_poll(
            read,
            done=lambda triple: triple[0].state != AdmissionState.WAITING or triple[2] is not None,
            topics=[ref, admission.parent_id],
            timeout_ms=s.clamp_wait_ms(data["waitMs"]) if was_waiting else 0,
            share=("admission", ref, visibility),
        )
        if refusal is not None:
            raise refusal
        admitted = found.state == AdmissionState.ADMITTED and (answer.admitted_now or was_waiting)
        headers = {"Location": f"/v1/admissions/{found.id}"}
        return Response(body, status=201 if admitted else 200, headers=headers)


class AdmissionDetailView(ApiView):
    """An admission's view."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="admissions_retrieve", responses=with_errors({200: a.AdmissionOut}))
    def get(self, request, admission_id):
        """Return the admission: its state, place in line and (once admitted) its run."""
        return Response(a.present_admission(selectors.admission_get(self.visibility, admission_id)))


class AdmissionWithdrawView(ApiView):
    """Leave the line."""

    @extend_schema(operation_id="admissions_withdraw", request=None, responses=with_errors({200: a.AdmissionOut}))
    def post(self, request, admission_id):
        """Withdraw a waiting admission (409 ``INVALID_STATE`` once admitted)."""
        admission = selectors.admission_get(self.visibility, admission_id)
        admission = admission_services.admission_withdraw(project_id=self.project_id, admission_id=admission.id)
        return Response(a.present_admission(selectors.admission_get(self.visibility, admission.id)))
