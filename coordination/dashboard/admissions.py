"""The dashboard's admissions panel: admitted and waiting per parent run."""

from dataclasses import dataclass

from django.db.models import Q

from coordination.models import AdmissionConfig
from coordination.reads.project_scope import ProjectScope, of_projects

ROWS = 20


@dataclass(frozen=True)
class AdmissionLine:
    config: AdmissionConfig

    @property
    def limit(self) -> str:
        return "no limit" if self.config.max_active is None else str(self.config.max_active)

    @property
    def full_percent(self) -> int:
        """Return how full the run's slots are, 0-100 (0 without a limit)."""
        if not self.config.max_active:
            return 100 if self.config.max_active == 0 else 0
        return min(100, round(100 * self.config.admitted / self.config.max_active))


def admission_lines(projects: ProjectScope = None) -> list[AdmissionLine]:
    """Return the runs with admitted or waiting admissions, the longest lines first."""
    configs = AdmissionConfig.objects.filter(Q(admitted__gt=0) | Q(waiting__gt=0)).select_related("run")
    configs = of_projects(configs, projects)
    return [AdmissionLine(config) for config in configs.order_by("-waiting", "-admitted", "id")[:ROWS]]
