"""Routes of ``/v1``."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from coordination.api.views import events, health, runs, work

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
    path("mailboxes/<str:name>", work.MailboxView.as_view(), name="mailbox"),
    path("mailboxes/<str:name>/tasks", work.TaskSubmitView.as_view(), name="mailbox-tasks"),
    path("mailboxes/<str:name>/claims", work.ClaimCollectionView.as_view(), name="mailbox-claims"),
    path("tasks/<str:task_id>", work.TaskDetailView.as_view(), name="task-detail"),
    path("tasks/<str:task_id>/result", work.TaskResultView.as_view(), name="task-result"),
    path("tasks/<str:task_id>/cancel", work.TaskCancelView.as_view(), name="task-cancel"),
    path("claims/<str:claim_id>/renew", work.ClaimRenewView.as_view(), name="claim-renew"),
    path("claims/<str:claim_id>/complete", work.ClaimCompleteView.as_view(), name="claim-complete"),
    path("claims/<str:claim_id>/fail", work.ClaimFailView.as_view(), name="claim-fail"),
    path("claims/<str:claim_id>/release", work.ClaimReleaseView.as_view(), name="claim-release"),
]
