"""``/v1/metrics``: Prometheus' text format, no key needed."""

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from prometheus_client import CONTENT_TYPE_LATEST
from rest_framework.permissions import AllowAny
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.views import APIView

from coordination import metrics
from coordination.api.negotiation import FirstRenderer


class PrometheusTextRenderer(BaseRenderer):
    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):  # noqa: D102
        return data


class MetricsView(APIView):
    """Every ``runstate_*`` metric (see ``coordination.metrics`` for where each comes from)."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes: list = []
    renderer_classes = [PrometheusTextRenderer]
    content_negotiation_class = FirstRenderer

    def handle_exception(self, exc):
        """Answer an error (a 405, say) with the JSON envelope: the text renderer has no shape for it."""
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return super().handle_exception(exc)

    @extend_schema(
        operation_id="metrics",
        responses={(200, "text/plain"): OpenApiResponse(OpenApiTypes.STR, description="Prometheus text format 0.0.4.")},
    )
    def get(self, request):
        """Return the metrics for Prometheus (``runstate_*``)."""
        return HttpResponse(metrics.render(), content_type=CONTENT_TYPE_LATEST)
