"""``/v1/barriers`` and ``/v1/timers``."""

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.longpoll import Answer, Watched, long_poll
from coordination.api.presenters import present_barrier, present_timer
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain import exceptions
from coordination.domain.states import BarrierState, Permission, TimerState
from coordination.reads import selectors
from coordination.reads.selectors import Visibility
from coordination.services import barriers as barrier_services
from coordination.services import timers as timer_services


class BarrierCollectionView(ApiView):
    """Create a barrier."""

    required_permissions = {"POST": Permission.RESOURCE_CONFIG}

    @extend_schema(
        operation_id="barriers_create", request=s.BarrierCreateIn, responses=with_errors({201: s.BarrierOut})
    )
    def post(self, request):
        """Create a barrier under an active run."""
        data = self.body(s.BarrierCreateIn)
        run = selectors.run_get(self.visibility, data["runId"])
        barrier = barrier_services.barrier_create(
            project_id=self.project_id, run_id=run.id, target=data["target"], name=data["name"]
        )
        return Response(present_barrier(barrier), status=201, headers={"Location": f"/v1/barriers/{barrier.id}"})


class BarrierDetailView(ApiView):
    """A barrier's view."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="barriers_retrieve", responses=with_errors({200: s.BarrierOut}))
    def get(self, request, barrier_id):
        """Return the barrier in its current epoch."""
        return Response(present_barrier(selectors.barrier_get(self.visibility, barrier_id)))


class BarrierArriveView(ApiView):
    """Arrive at a barrier."""

    @extend_schema(
        operation_id="barriers_arrive", request=s.BarrierArriveIn, responses=with_errors({200: s.BarrierOut})
    )
    def post(self, request, barrier_id):
        """Record the key's arrival (idempotent per key within an epoch)."""
        data = self.body(s.BarrierArriveIn)
        barrier = selectors.barrier_get(self.visibility, barrier_id)
        barrier = barrier_services.barrier_arrive(project_id=self.project_id, barrier_id=barrier.id, key=data["key"])
        return Response(present_barrier(barrier))


class BarrierNextEpochView(ApiView):
    """Re-arm a released barrier."""

    @extend_schema(operation_id="barriers_next_epoch", request=None, responses=with_errors({200: s.BarrierOut}))
    def post(self, request, barrier_id):
        """Move a released barrier to epoch + 1 with no arrivals."""
        barrier = selectors.barrier_get(self.visibility, barrier_id)
        barrier = barrier_services.barrier_next_epoch(project_id=self.project_id, barrier_id=barrier.id)
        return Response(present_barrier(barrier))


class BarrierWaitView(AsyncApiView):
    """Long-poll a barrier's release."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="barriers_wait", parameters=[s.WaitQuery], responses=with_errors({200: s.BarrierOut}))
    async def get(self, request, barrier_id):
        """Answer once released (409 ``BARRIER_CANCELLED`` if cancelled), or the view after ``timeoutMs``."""
        query = self.query(s.WaitQuery)
        self.hold_wait(query["timeoutMs"])
        watched = barrier_watched(self.visibility, selectors.parse_id(barrier_id, what="Barrier"))
        barrier, answer = await long_poll(**watched._asdict(), timeout_ms=s.clamp_wait_ms(query["timeoutMs"]))
        barrier_refuse_cancelled(barrier)
        return self.shared_answer(answer, wait="barrier")


class TimerCollectionView(ApiView):
    """Arm a timer."""

    @extend_schema(operation_id="timers_create", request=s.TimerCreateIn, responses=with_errors({201: s.TimerOut}))
    def post(self, request):
        """Arm a timer at ``at`` or after ``afterSeconds`` (exactly one); a past ``at`` fires at once."""
        data = self.body(s.TimerCreateIn)
        run = selectors.run_get(self.visibility, data["runId"])
        timer = timer_services.timer_create(
            project_id=self.project_id, run_id=run.id, at=data["at"], after_seconds=data["afterSeconds"]
        )
        return Response(present_timer(timer), status=201, headers={"Location": f"/v1/timers/{timer.id}"})


class TimerDetailView(ApiView):
    """Read a timer."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="timers_retrieve", responses=with_errors({200: s.TimerOut}))
    def get(self, request, timer_id):
        """Return the timer."""
        return Response(present_timer(selectors.timer_get(self.visibility, timer_id)))


class TimerWaitView(AsyncApiView):
    """Long-poll a timer's firing and acknowledge it in the same call."""

    @extend_schema(
        operation_id="timers_wait", parameters=[s.WaitQuery], request=None, responses=with_errors({200: s.TimerOut})
    )
    async def post(self, request, timer_id):
        """Answer once fired, acknowledged (idempotent); the armed timer after ``timeoutMs``."""
        query = self.query(s.WaitQuery)
        self.hold_wait(query["timeoutMs"])
        watched = timer_watched(self.visibility, selectors.parse_id(timer_id, what="Timer"))
        _, answer = await long_poll(**watched._asdict(), timeout_ms=s.clamp_wait_ms(query["timeoutMs"]))
        return self.shared_answer(answer, wait="timer")


def barrier_watched(visibility: Visibility, ref) -> Watched:
    """Return what a wait on a barrier watches (its view and the hot path): the barrier until it leaves WAITING."""

    def read():
        barrier = selectors.barrier_get(visibility, ref)
        return barrier, Answer(present_barrier(barrier))

    return Watched(read, lambda pair: pair[0].state != BarrierState.WAITING, [ref], ("barrier", ref, visibility))


def barrier_refuse_cancelled(barrier) -> None:
    """Refuse a barrier wait's answer with ``BARRIER_CANCELLED`` when the barrier it waited on was cancelled."""
    if barrier.state == BarrierState.CANCELLED:
        raise exceptions.BarrierCancelled(barrierId=str(barrier.id))


def timer_watched(visibility: Visibility, ref) -> Watched:
    """Return what a wait on a timer watches (its view and the hot path): the timer, acknowledged once fired.

    Re-read when it is due; the caller's project is the visibility's.
    """
    project_id = visibility.project_id

    def read():
        timer = selectors.timer_get(visibility, ref)
        timer = timer_services.timer_acknowledge(project_id=project_id, timer_id=timer.id)
        return timer, Answer(present_timer(timer))

    return Watched(
        read,
        lambda pair: pair[0].state == TimerState.ACKNOWLEDGED,
        [ref],
        ("timer", ref, visibility, project_id),
        due_in_s=lambda pair: (pair[0].fire_at - timezone.now()).total_seconds(),
    )


class TimerCancelView(ApiView):
    """Disarm a timer."""

    @extend_schema(operation_id="timers_cancel", request=None, responses=with_errors({200: s.TimerOut}))
    def post(self, request, timer_id):
        """Disarm an armed timer (409 ``TIMER_FIRED`` once it fired)."""
        timer = selectors.timer_get(self.visibility, timer_id)
        return Response(present_timer(timer_services.timer_cancel(project_id=self.project_id, timer_id=timer.id)))
