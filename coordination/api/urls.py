"""Routes of ``/v1``."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from coordination.api.views import events, health, runs

urlpatterns = [
    path("healthz", health.HealthView.as_view(), name="healthz"),
    path("readyz", health.ReadyView.as_view(), name="readyz"),
    path("schema", SpectacularAPIView.as_view(), name="schema"),
    path("docs", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("runs", runs.RunCollectionView.as_view(), name="runs"),
    path("runs/<str:run_id>", runs.RunDetailView.as_view(), name="run-detail"),
    path("runs/<str:run_id>/children", runs.RunChildrenView.as_view(), name="run-children"),
    path("runs/<str:run_id>/cancel", runs.RunCancelView.as_view(), name="run-cancel"),
    path("runs/<str:run_id>/complete", runs.RunCompleteView.as_view(), name="run-complete"),
    path("events", events.EventListView.as_view(), name="events"),
]
