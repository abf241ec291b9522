"""Celery integration: runstate-aware task decorator, worker runtime, periodic sweeps.

``from workers import runstate_task, TaskContext, TaskCancelled``. The names load lazily, so
Django can import this app before its models are ready.
"""

__all__ = ["TaskCancelled", "TaskContext", "runstate_task"]


def __getattr__(name: str):
    if name == "runstate_task":
        from workers.decorators import runstate_task

        return runstate_task
    if name in ("TaskContext", "TaskCancelled"):
        from workers import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
