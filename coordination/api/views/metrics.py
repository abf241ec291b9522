"""``/v1/metrics``: Prometheus' text format, for the scrape token (every project) or a project's key (its own)."""

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from prometheus_client import CONTENT_TYPE_LATEST
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.views import APIView

from coordination.api.auth import ApiKeyAuthentication, CanReadMetrics, MetricsScraper, MetricsTokenAuthentication
from coordination.api.negotiation import FirstRenderer
from coordination.api.views.base import ERRORS
from coordination.domain.states import Permission
from coordination.plumbing import metrics


class PrometheusTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):  # noqa: D102
        return data


class MetricsView(APIView):
    """Every ``runstate_*`` metric (see ``coordination.plumbing.metrics`` for where each comes from).

    ``RUNSTATE_METRICS_TOKEN`` sees every project's series and the service's own (requests,
    sweeps, the event fold); a key with ``coordination_read`` sees its project's series read
    from the database; a key bound to a run is refused. A key's scrape counts against its
    rate limit; the token's does not.
    """

    authentication_classes = [MetricsTokenAuthentication, ApiKeyAuthentication]
    permission_classes = [CanReadMetrics]
    required_permissions = {"GET": Permission.COORDINATION_READ}
    renderer_classes = [PrometheusTextRenderer]
    content_negotiation_class = FirstRenderer

    def handle_exception(self, exc):
        """Answer an error (a 401, a 405, say) with the JSON envelope: the text renderer has no shape for it."""
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return super().handle_exception(exc)

    @extend_schema(
        operation_id="metrics",
        responses={
            (200, "text/plain"): OpenApiResponse(
                OpenApiTypes.STR,
                description="Prometheus text format 0.0.4: every project's series for the scrape token, "
                "the key's project's for a key.",
            ),
            # Errors are JSON (``handle_exception``), not the text the renderer gives.
            (401, "application/json"): ERRORS[401],
            (403, "application/json"): ERRORS[403],
        },
    )
    def get(self, request):
        """Return the metrics for Prometheus (``runstate_*``): all of them, or the key's project's."""
        if isinstance(request.user, MetricsScraper):
            return HttpResponse(metrics.render(), content_type=CONTENT_TYPE_LATEST)
        project_id = request.user.api_key.project_id
        return HttpResponse(metrics.render(project_id=project_id), content_type=CONTENT_TYPE_LATEST)
