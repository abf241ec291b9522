"""Routes of ``/v1``."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from coordination.api.views import events, groups, health, messages, runs, work

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
    path("mailboxes/<str:name>/messages", messages.MessageSendView.as_view(), name="mailbox-messages"),
    path("mailboxes/<str:name>/deliveries", messages.DeliveryCollectionView.as_view(), name="mailbox-deliveries"),
    path("messages/<str:message_id>", messages.MessageDetailView.as_view(), name="message-detail"),
    path("deliveries/<str:delivery_id>/complete", messages.DeliveryCompleteView.as_view(), name="delivery-complete"),
    path("deliveries/<str:delivery_id>/retry", messages.DeliveryRetryView.as_view(), name="delivery-retry"),
    path("deliveries/<str:delivery_id>/reject", messages.DeliveryRejectView.as_view(), name="delivery-reject"),
    path("groups", groups.GroupCollectionView.as_view(), name="groups"),
    path("groups/<str:group_id>", groups.GroupDetailView.as_view(), name="group-detail"),
    path("groups/<str:group_id>/wait", groups.GroupWaitView.as_view(), name="group-wait"),
    path("groups/<str:group_id>/members", groups.GroupMemberSubmitView.as_view(), name="group-members"),
    path("groups/<str:group_id>/join", groups.GroupJoinView.as_view(), name="group-join"),
    path("groups/<str:group_id>/close", groups.GroupCloseView.as_view(), name="group-close"),
    path("groups/<str:group_id>/seal", groups.GroupSealView.as_view(), name="group-seal"),
    path("groups/<str:group_id>/members/<str:task_id>/accept", groups.MemberAcceptView.as_view(), name="member-accept"),
    path("groups/<str:group_id>/members/<str:task_id>/reject", groups.MemberRejectView.as_view(), name="member-reject"),
]
