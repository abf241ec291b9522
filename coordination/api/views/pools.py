"""``/v1/pools/{name}`` and ``/v1/pool-leases/{id}``: concurrency limits with leases.

The pools' request and response shapes live here with their views (not in the shared
``serializers``/``presenters`` modules), so the feature stays in one place.
"""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from coordination.api import serializers as s
from coordination.api.longpoll import db, in_request, long_poll
from coordination.api.presenters import iso
from coordination.api.views.base import ApiView, AsyncApiView, with_errors
from coordination.domain import exceptions
from coordination.domain.states import Permission, PoolLeaseState
from coordination.models import Pool, PoolLease
from coordination.plumbing import tracing
from coordination.reads import selectors
from coordination.services import pools as pool_services

# Shapes ------------------------------------------------------------------------------------


class PoolPutIn(s.StrictSerializer):
    """Body of ``PUT /v1/pools/{name}``."""

    capacity = s.StrictIntegerField(min_value=1, max_value=pool_services.MAX_CAPACITY)


class PoolOut(serializers.Serializer):
    """A pool and its use (an expired lease never counts in use)."""

    name = serializers.CharField()
    capacity = serializers.IntegerField()
    inUse = serializers.IntegerField()
    waiting = serializers.IntegerField()


class PoolAcquireIn(s.StrictSerializer):
    """Body of ``POST /v1/pools/{name}/leases``."""

    runId = s.StrictCharField(max_length=100)
    units = s.StrictIntegerField(required=False, min_value=1, max_value=pool_services.MAX_CAPACITY, default=1)
    leaseTtlMs = s.StrictIntegerField(
        required=False, min_value=100, max_value=pool_services.MAX_LEASE_TTL_MS, default=None, allow_null=True
    )
    waitMs = s.StrictIntegerField(required=False, min_value=0, default=0)
    key = s.StrictCharField(required=False, allow_blank=True, max_length=200, default="")


class PoolLeaseRenewIn(s.StrictSerializer):
    """Body of ``POST /v1/pool-leases/{id}/renew``."""

    leaseTtlMs = s.StrictIntegerField(
        required=False, min_value=100, max_value=pool_services.MAX_LEASE_TTL_MS, default=None, allow_null=True
    )


class PoolLeaseOut(serializers.Serializer):
    """A pool lease (``state`` HELD while it counts in use)."""

    leaseId = serializers.CharField()
    pool = serializers.CharField()
    runId = serializers.CharField()
    units = serializers.IntegerField()
    key = serializers.CharField(allow_null=True)
    state = serializers.ChoiceField(choices=PoolLeaseState.choices)
    expiresAt = serializers.DateTimeField()
    grantedAt = serializers.DateTimeField(allow_null=True)


def present_pool(pool: Pool, visibility: selectors.Visibility) -> dict:
    """Return the API shape of a pool, its use counted from the open leases the caller sees.

    A key bound to a run sees only its subtree's leases: ``inUse`` and ``waiting`` are then
    that subtree's share, not the whole project's (so ``capacity - inUse`` is not the room).
    """
    in_use, waiting = pool_services.pool_stats([pool], under=visibility.bound_path)[pool.id]
    return {"name": pool.name, "capacity": pool.capacity, "inUse": in_use, "waiting": waiting}


def pool_refusal_seen(
    visibility: selectors.Visibility, project_id, name: str, refusal: exceptions.CoordinationError
) -> exceptions.CoordinationError:
    """Return ``refusal`` as the caller may see it: a bound key's ``POOL_EXHAUSTED`` counts its subtree only."""
    if not isinstance(refusal, exceptions.PoolExhausted) or visibility.bound_path is None:
        return refusal
    seen = present_pool(pool_services.pool_get(project_id=project_id, name=name), visibility)
    return exceptions.PoolExhausted(capacity=seen["capacity"], inUse=seen["inUse"], waiting=seen["waiting"])


def present_pool_lease(lease: PoolLease, pool_name: str) -> dict:
    """Return the API shape of a pool lease."""
    return {
        "leaseId": str(lease.id),
        "pool": pool_name,
        "runId": str(lease.run_id),
        "units": lease.units,
        "key": lease.key or None,
        "state": lease.state,
        "expiresAt": iso(lease.expires_at),
        "grantedAt": iso(lease.granted_at),
    }


def pool_lease_get(visibility: selectors.Visibility, lease_id: object) -> PoolLease:
    """Return a visible pool lease (with its pool), or raise ``NotFound``."""
    parsed = selectors.parse_id(lease_id, what="Pool lease")
    lease = PoolLease.objects.select_related("pool").filter(project_id=visibility.project_id, id=parsed).first()
    if lease is None or not visibility.sees_path(lease.run_path):
        raise exceptions.NotFound("Pool lease not found.", leaseId=str(lease_id))
    return lease


# Views -------------------------------------------------------------------------------------


class PoolView(ApiView):
    """Configure or read a pool."""

    required_permissions = {"GET": Permission.COORDINATION_READ, "PUT": Permission.RESOURCE_CONFIG}
    project_wide = frozenset({"PUT"})  # a bound key's GET counts only its subtree's leases

    @extend_schema(operation_id="pools_put", request=PoolPutIn, responses=with_errors({200: PoolOut, 201: PoolOut}))
    def put(self, request, name):
        """Create the pool (201) or change its capacity (200); a shrink revokes nothing; refused to a bound key."""
        data = self.body(PoolPutIn)
        pool, created = pool_services.pool_put(project_id=self.project_id, name=name, capacity=data["capacity"])
        headers = {"Location": f"/v1/pools/{pool.name}"} if created else {}
        return Response(present_pool(pool, self.visibility), status=201 if created else 200, headers=headers)

    @extend_schema(operation_id="pools_retrieve", responses=with_errors({200: PoolOut}))
    def get(self, request, name):
        """Return the pool and its use (a key bound to a run: its subtree's use only)."""
        pool = pool_services.pool_get(project_id=self.project_id, name=name)
        return Response(present_pool(pool, self.visibility))


class PoolLeaseCollectionView(AsyncApiView):
    """Acquire units of a pool, optionally waiting in its queue."""

    @extend_schema(
        operation_id="pools_acquire",
        request=PoolAcquireIn,
        responses=with_errors(
            {
                201: PoolLeaseOut,
                200: OpenApiResponse(PoolLeaseOut, description="the lease already held under this key"),
            }
        ),
    )
    async def post(self, request, name):
        """Grant a lease when the units fit and nobody waits before it; else wait up to ``waitMs`` (max 30 s).

        409 ``POOL_EXHAUSTED`` (``details: {capacity, inUse, waiting}``) when not granted in time.
        """
        data = self.body(PoolAcquireIn)
        self.hold_wait(data["waitMs"])
        project_id, visibility = self.project_id, self.visibility
        wait_ms = s.clamp_wait_ms(data["waitMs"])

        def acquire():
            run = selectors.run_ref(visibility, data["runId"])
            acquired = pool_services.pool_acquire(
                project_id=project_id,
                name=name,
                run_id=run.id,
                units=data["units"],
                lease_ttl_ms=data["leaseTtlMs"],
                wait_ms=wait_ms,
                key=data["key"],
            )
            return run, acquired

        run, acquired = await in_request(acquire)
        if acquired.refusal is not None:
            raise await db(pool_refusal_seen, visibility, project_id, name, acquired.refusal)
        lease = acquired.lease
        if lease.state == PoolLeaseState.WAITING:
            # Woken by the grant's pool.acquired (subject: this lease) or by a run.* event of
            # the chain (a cancel answers at once); rechecked every second regardless.
            with tracing.span(
                f"wait pool {name}", parent=self.caller_trace(), pool=name, run_id=run.id, units=data["units"]
            ) as waiting:
                await long_poll(
                    lambda: pool_services.pool_wait_read(lease_id=lease.id),
                    done=lambda pair: pair[1],
                    topics=[lease.id, *run.chain_ids],
                    timeout_ms=wait_ms,
                )
                acquired = await db(pool_services.pool_wait_end, lease_id=lease.id)
                tracing.annotate(
                    waiting, granted=acquired.refusal is None and acquired.lease.state != PoolLeaseState.WAITING
                )
            if acquired.refusal is not None:
                raise await db(pool_refusal_seen, visibility, project_id, name, acquired.refusal)
            lease = acquired.lease
        status = 201 if acquired.created else 200
        return Response(
            present_pool_lease(lease, name), status=status, headers={"Location": f"/v1/pool-leases/{lease.id}"}
        )


class PoolLeaseDetailView(ApiView):
    """Read a pool lease."""

    required_permissions = {"GET": Permission.COORDINATION_READ}

    @extend_schema(operation_id="pool_leases_retrieve", responses=with_errors({200: PoolLeaseOut}))
    def get(self, request, lease_id):
        """Return the lease."""
        lease = pool_lease_get(self.visibility, lease_id)
        return Response(present_pool_lease(lease, lease.pool.name))


class PoolLeaseRenewView(ApiView):
    """Renew a held pool lease."""

    @extend_schema(
        operation_id="pool_leases_renew", request=PoolLeaseRenewIn, responses=with_errors({200: PoolLeaseOut})
    )
    def post(self, request, lease_id):
        """Extend the lease; ``LEASE_LOST`` once released or expired, the run's code once it is inactive."""
        data = self.body(PoolLeaseRenewIn)
        lease = pool_lease_get(self.visibility, lease_id)
        renewed = pool_services.pool_lease_renew(
            project_id=self.project_id, lease_id=lease.id, lease_ttl_ms=data["leaseTtlMs"]
        )
        return Response(present_pool_lease(renewed, lease.pool.name))


class PoolLeaseReleaseView(ApiView):
    """Release a pool lease."""

    @extend_schema(operation_id="pool_leases_release", request=None, responses=with_errors({200: PoolLeaseOut}))
    def post(self, request, lease_id):
        """Hand the units back (idempotent, allowed under an inactive run)."""
        lease = pool_lease_get(self.visibility, lease_id)
        released = pool_services.pool_lease_release(project_id=self.project_id, lease_id=lease.id)
        return Response(present_pool_lease(released, lease.pool.name))
