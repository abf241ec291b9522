"""The coordination models, one module per aggregate."""

from .clock import Barrier, BarrierArrival, Timer
from .events import Event
from .groups import GroupMember, TaskGroup
from .limits import Budget, BudgetReservation, Quota
from .projects import ApiKey, Project
from .runs import Run
from .work import Mailbox, Message, Task

__all__ = [
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
]
