"""The dashboard's quotas-and-budgets panel: bucket levels and budget bars."""

from django.utils import timezone

from coordination.admin.base import change_url
from coordination.domain.states import RunState
from coordination.models import Budget, Quota
from coordination.reads.project_scope import ProjectScope, of_projects
from coordination.services.quotas import available

# The panel shows this many budgets of active runs, the fullest first.
BUDGETS_SHOWN = 20


def _percent(used: int, limit: int) -> int:
    return 100 if limit <= 0 else min(100, round(100 * used / limit))


def quota_budget_rows(projects: ProjectScope) -> dict:
    """Return the panel's quotas (level now) and the budgets of active runs (spent, reserved, limit)."""
    now = timezone.now()
    quotas = of_projects(Quota.objects.select_related("project").order_by("project__name", "name"), projects)
    budgets = of_projects(Budget.objects.filter(run__stored_state=RunState.ACTIVE).select_related("project"), projects)
    quota_rows = []
    for quota in quotas[:100]:
        tokens = available(quota, now)
        quota_rows.append(
            {"quota": quota, "available": tokens, "percent": _percent(tokens, quota.limit), "url": change_url(quota)}
        )
    budget_rows = [
        {
            "budget": budget,
            "spent_percent": _percent(budget.spent, budget.limit),
            "reserved_percent": _percent(budget.reserved, budget.limit),
            "url": change_url(budget),
        }
        for budget in budgets.order_by("-created_at")[: BUDGETS_SHOWN * 5]
    ]
    budget_rows.sort(key=lambda row: -(row["spent_percent"] + row["reserved_percent"]))
    return {"quotas": quota_rows, "budgets": budget_rows[:BUDGETS_SHOWN]}
