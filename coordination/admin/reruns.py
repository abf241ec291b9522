"""The task admin's "Rerun selected" action: each finished task submitted again through ``task_rerun``."""

from collections import defaultdict

from django.contrib import admin, messages

from coordination.domain.exceptions import CoordinationError
from coordination.services.reruns import task_rerun


@admin.action(description="Rerun selected tasks (each finished one as a new task)", permissions=["change"])
def rerun_selected(modeladmin, request, queryset):
    """Rerun each selected task with its own input; report what was rerun and why others were refused."""
    outcomes: dict[str, list[str]] = defaultdict(list)
    for task in queryset.select_related(None).order_by("id").only("id", "project_id", "state"):
        # One transaction per task (the service's own): a refusal leaves the others' reruns.
        try:
            new, _ = task_rerun(project_id=task.project_id, task_id=task.id)
        except CoordinationError as error:
            outcomes["refused"].append(f"{task}: {error.code} ({error.message})")
            continue
        outcomes["rerun"].append(f"{task} as {new.id}")
    modeladmin._report(
        request,
        outcomes,
        {
            "rerun": (messages.SUCCESS, "Rerun {} (each as a new queued task in the same mailbox and run)"),
            "refused": (messages.ERROR, "Could not rerun {}"),
        },
    )
