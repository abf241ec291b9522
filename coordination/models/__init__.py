"""The coordination models, one module per aggregate."""

from .events import Event
from .groups import GroupMember, TaskGroup
from .projects import ApiKey, Project
from .runs import Run
from .work import Mailbox, Message, Task

__all__ = ["ApiKey", "Event", "GroupMember", "Mailbox", "Message", "Project", "Run", "Task", "TaskGroup"]
