"""The operator dashboard: one ModelAdmin module per aggregate.

Every change made here goes through ``coordination.services``; the admin never writes a
state field (``Run.stored_state``, ``ApiKey.revoked_at``…) itself.
"""

from django.contrib import admin

from .admissions import AdmissionAdmin, AdmissionConfigAdmin
from .beat import GuardedPeriodicTaskAdmin
from .clock import BarrierAdmin, TimerAdmin
from .events import EventAdmin
from .groups import TaskGroupAdmin
from .keys import ApiKeyAdmin
from .limits import BudgetAdmin, BudgetReservationAdmin, QuotaAdmin
from .login import ThrottledAdminAuthenticationForm
from .pools import PoolAdmin, PoolLeaseAdmin
from .projects import ProjectAdmin
from .runs import RunAdmin
from .work import MailboxAdmin, MessageAdmin, TaskAdmin

# The operators' console says what it is, not Django's stock "Django administration".
admin.site.site_header = "runstate"
admin.site.site_title = "runstate admin"
admin.site.index_title = "Runs, work and limits"

__all__ = [
    "AdmissionAdmin",
    "AdmissionConfigAdmin",
    "BudgetAdmin",
    "BudgetReservationAdmin",
    "QuotaAdmin",
    "ApiKeyAdmin",
    "BarrierAdmin",
    "EventAdmin",
    "GuardedPeriodicTaskAdmin",
    "MailboxAdmin",
    "MessageAdmin",
    "PoolAdmin",
    "PoolLeaseAdmin",
    "ProjectAdmin",
    "RunAdmin",
    "TaskAdmin",
    "TaskGroupAdmin",
    "TimerAdmin",
]

# Failed logins are counted per username and per address, and refused past the limit.
admin.site.login_form = ThrottledAdminAuthenticationForm
