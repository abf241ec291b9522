"""``/v1/quotas``: token buckets."""

import asyncio

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from coordination.api import draining
from coordination.api import limit_shapes as ls
from coordination.api import serializers as s
from coordination.api.longpoll import db, in_request
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain import exceptions
from coordination.domain.states import Permission
from coordination.plumbing import tracing
from coordination.plumbing.notify import RECHECK_S, hub
from coordination.reads import selectors
from coordination.services import quotas as quota_services

# On SQLite (no NOTIFY) a waiting take re-checks its run at least this often.
SQLITE_RECHECK_S = 0.25


class QuotaView(ApiView):
    """Configure or read a quota."""

    required_permissions = {"GET": Permission.COORDINATION_READ, "PUT": Permission.RESOURCE_CONFIG}
    # A bucket's level is everybody's use at once, with no subtree share to show: a bound key
    # is refused the read as well as the configuration (it still takes, for its own runs).
    project_wide = frozenset({"GET", "PUT"})

    @extend_schema(
        operation_id="quotas_put", request=ls.QuotaPutIn, responses=with_errors({200: ls.QuotaOut, 201: ls.QuotaOut})
    )
    def put(self, request, name):
        """Create the quota full (201) or change its limit and period (200), keeping its level.

        Refused to a key bound to a run (``PERMISSION_DENIED``).
        """
        data = self.body(ls.QuotaPutIn)
        quota, created = quota_services.quota_put(
            project_id=self.project_id, name=name, limit=data["limit"], period_ms=data["periodMs"]
        )
        headers = {"Location": f"/v1/quotas/{quota.name}"} if created else {}
        return Response(ls.present_quota(quota), status=201 if created else 200, headers=headers)

    @extend_schema(operation_id="quotas_retrieve", responses=with_errors({200: ls.QuotaOut}))
    def get(self, request, name):
        """Return the quota with the tokens it holds now; refused to a key bound to a run (``PERMISSION_DENIED``)."""
        return Response(ls.present_quota(quota_services.quota_get(project_id=self.project_id, name=name)))


class QuotaTakeView(AsyncApiView):
    """Take tokens from a quota, optionally waiting for them."""

    @extend_schema(operation_id="quotas_take", request=ls.QuotaTakeIn, responses=with_errors({200: ls.QuotaTakeOut}))
    async def post(self, request, name):
        """Take ``amount`` tokens for work under ``runId``; with ``waitMs``, wait up to that long (max 30 s).

        Refused with ``QUOTA_EXHAUSTED`` (``details.retryAfterMs``) when the tokens are not
        there within the wait; with the run's code when it is inactive, at once, also while
        waiting.
        """
        data = self.body(ls.QuotaTakeIn)
        self.hold_wait(data["waitMs"])
        project_id, visibility = self.project_id, self.visibility
        run = await in_request(selectors.run_ref, visibility, data["runId"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.clamp_wait_ms(data["waitMs"]) / 1000

        def take():
            left_ms = max(0, int((deadline - loop_now) * 1000))
            return quota_services.quota_take(
                project_id=project_id, run_id=run.id, name=name, amount=data["amount"], wait_left_ms=left_ms
            )

        # A run event (cancel, complete) on the chain wakes a sleeping take, which then
        # re-checks the run: a waiting take is answered with the run's code at once.
        waiter = hub.subscribe(run.chain_ids) if data["waitMs"] > 0 else None
        try:
            if waiter is not None:
                await hub.ready()  # listening before the first take: no cancel can slip between
            loop_now = loop.time()
            outcome = await in_request(take)
            if not outcome.granted and not outcome.final:
                with tracing.span(
                    f"wait quota {name}", parent=self.caller_trace(), quota=name, run_id=run.id, amount=data["amount"]
                ) as waiting:
                    while not outcome.granted and not outcome.final and not draining.draining():
                        # Refill is time-based: sleep until the tokens are due, not polling meanwhile;
                        # but re-check the run at least every RECHECK_S, since a passing deadline
                        # announces itself with no event (SQLite has no NOTIFY at all: more often).
                        pause_s = min(outcome.retry_after_ms / 1000, deadline - loop.time())
                        if hub.enabled():
                            await waiter.wait(min(pause_s, RECHECK_S))
                        else:
                            await asyncio.sleep(max(min(pause_s, SQLITE_RECHECK_S), 0))
                        loop_now = loop.time()
                        outcome = await db(take)
                    tracing.annotate(waiting, granted=outcome.granted)
        finally:
            if waiter is not None:
                hub.unsubscribe(waiter)
        if not outcome.granted:
            raise exceptions.QuotaExhausted(retryAfterMs=outcome.retry_after_ms)
        return Response({"granted": True, "remaining": outcome.remaining})
