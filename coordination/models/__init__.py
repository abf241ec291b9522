"""The coordination models, one module per aggregate."""

from .events import Event
from .projects import ApiKey, Project
from .runs import Run
from .work import Mailbox, Message, Task

__all__ = ["ApiKey", "Event", "Mailbox", "Message", "Project", "Run", "Task"]
