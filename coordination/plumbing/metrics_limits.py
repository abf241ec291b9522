"""Gauges of quotas and budgets, read at each scrape (``coordination.plumbing.metrics.DatabaseCollector``)."""

import uuid
from datetime import datetime

from prometheus_client.core import GaugeMetricFamily

from coordination.domain.states import RunState
from coordination.models import Budget, Quota
from coordination.services.quotas import available


def limit_families(now: datetime, project_id: uuid.UUID | None = None) -> list[GaugeMetricFamily]:
    """Return ``runstate_quota_available`` and ``runstate_budget_remaining`` (of one project, or of every one).

    Budgets are reported only while their own run is ``ACTIVE``: a budget is per run, so
    ended runs would otherwise grow the series without bound.
    """
    quotas = GaugeMetricFamily(
        "runstate_quota_available", "Whole tokens a quota's bucket holds now.", labels=["project", "quota"]
    )
    scope = {} if project_id is None else {"project_id": project_id}
    for quota in Quota.objects.filter(**scope).select_related("project").order_by("project__name", "name"):
        quotas.add_metric([quota.project.name, quota.name], available(quota, now))
    budgets = GaugeMetricFamily(
        "runstate_budget_remaining",
        "A budget's limit - spent - reserved, for budgets of active runs.",
        labels=["project", "budget", "run"],
    )
    rows = (
        Budget.objects.filter(run__stored_state=RunState.ACTIVE, **scope)
        .order_by("project__name", "name", "run_id")
        .values_list("project__name", "name", "run_id", "limit", "spent", "reserved")
    )
    for project_name, name, run_id, limit, spent, reserved in rows:
        budgets.add_metric([project_name, name, str(run_id)], limit - spent - reserved)
    return [quotas, budgets]
