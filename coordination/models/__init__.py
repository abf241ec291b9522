"""The coordination models, one module per aggregate."""

from .events import Event
from .projects import ApiKey, Project
from .runs import Run

__all__ = ["ApiKey", "Event", "Project", "Run"]
