"""The coordination models, one module per aggregate."""

from .admissions import Admission, AdmissionConfig
from .clock import Barrier, BarrierArrival, Timer
from .events import Event
from .groups import GroupMember, TaskGroup
from .limits import Budget, BudgetReservation, Quota
from .pools import Pool, PoolLease
from .projects import ApiKey, Project
from .runs import Run
from .work import Mailbox, Message, Task

__all__ = [
    "Admission",
    "AdmissionConfig",
    "Budget",
    "BudgetReservation",
    "Quota",
    "Barrier",
    "BarrierArrival",
    "Timer",
    "ApiKey",
    "Event",
    "GroupMember",
    "Mailbox",
    "Message",
    "Project",
    "Run",
    "Task",
    "TaskGroup",
    "Pool",
    "PoolLease",
]
