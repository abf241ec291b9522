"""``@runstate_task``: a Celery task bound to a runstate ``WORK`` mailbox.

A decorated function becomes a Celery task whose message carries only a runstate task id.
Submitting (``task.submit``, the API, the SDK, a group member) creates the runstate task; a
Celery message follows after commit (``workers.dispatch``). The worker claims that task by
id under a lease and runs the function with a context (``workers.runtime``). The database
decides everything; the message only wakes a worker.

Which project a decorated task lives in: the ``project=`` argument, else the setting
``RUNSTATE_DEFAULT_PROJECT`` (environment variable of the same name), else ``"default"``.
The project and the mailbox are ensured lazily, on the first submit or execution in a process.

A process knows a binding once it has imported the module that declares it: the worker
through Celery (``--include``, ``CELERY_IMPORTS``, autodiscovery) and every process through
``RUNSTATE_TASK_MODULES`` (imported when Django starts, see ``workers.apps``).
"""

from __future__ import annotations

import inspect
import os
import threading
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from celery import shared_task
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from workers.registry import registry

DEFAULT_PROJECT = "default"


def default_project_name() -> str:
    """Return the project of decorated tasks that name none."""
    return getattr(settings, "RUNSTATE_DEFAULT_PROJECT", None) or os.environ.get(
        "RUNSTATE_DEFAULT_PROJECT", DEFAULT_PROJECT
    )


# Worker processes cache mailboxes too (``workers.apps`` asks at a worker's start), from
# their first submit on: the LISTEN connection behind the cache is opened only in a process
# that submits, after any fork (a pool child opens its own), so a worker that never submits
# pays nothing for it.
_process_cache = {"asked": False, "started_in": None}
_process_cache_lock = threading.Lock()


def cache_mailboxes_in_this_worker(**signal_kwargs) -> None:
    """Have this worker's processes read the mailbox of every submit through ``coordination.plumbing.process_cache``."""
    _process_cache["asked"] = True


def _start_process_cache_if_asked() -> None:
    if not _process_cache["asked"] or _process_cache["started_in"] == os.getpid():
        return
    with _process_cache_lock:
        if _process_cache["started_in"] != os.getpid():
            from coordination.plumbing import process_cache

            process_cache.enable()
            _process_cache["started_in"] = os.getpid()


def _kwarg_names(fn: Callable) -> tuple[frozenset[str], bool]:
    """Return the keyword parameters ``fn`` declares after ``ctx``, and whether it takes ``**kwargs``."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    names = frozenset(
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )
    return names, takes_any


class RunstateTask:
    """A function bound to a runstate ``WORK`` mailbox and run by Celery workers.

    Call ``submit()`` to create work; call the object itself to run the function directly
    (with a context you built, e.g. in a unit test).
    """

    def __init__(
        self,
        fn: Callable,
        *,
        mailbox: str,
        project: str | None,
        lease_ttl: float | None,
        max_attempts: int | None,
        name: str | None,
        input_model: Any,
        input_schema: dict | None,
        retry_delay: float,
        retry_delay_max: float,
        celery_options: dict[str, Any],
    ) -> None:
        from coordination.domain.exceptions import ValidationFailed
        from coordination.services.mailboxes import (
            NAME_PATTERN,
            validate_lease_ttl_ms,
            validate_max_attempts,
        )

        if not NAME_PATTERN.match(mailbox or ""):
            raise ImproperlyConfigured(f"Invalid mailbox name {mailbox!r}.")
        self.fn = fn
        self.mailbox_name = mailbox
        self.project_name = project or default_project_name()
        self.lease_ttl_ms = round(lease_ttl * 1000) if lease_ttl is not None else None
        try:
            validate_lease_ttl_ms(self.lease_ttl_ms, field="lease_ttl")
            validate_max_attempts(max_attempts)
        except ValidationFailed as invalid:
            raise ImproperlyConfigured(f"@runstate_task({mailbox!r}): {invalid.details}") from None
        self.max_attempts = max_attempts
        self.name = name or f"{fn.__module__}.{fn.__qualname__}"
        self.input_model = input_model
        self.input_schema = input_schema
        self._schema_validator = _schema_validator(input_schema) if input_schema is not None else None
        self.retry_delay = retry_delay
        self.retry_delay_max = retry_delay_max
        self.is_async = inspect.iscoroutinefunction(fn)
        self.kwarg_names, self.takes_any_kwargs = _kwarg_names(fn)
        self._ids: tuple[uuid.UUID, uuid.UUID] | None = None
        self._ids_lock = threading.Lock()
        self.celery_task = self._make_celery_task(celery_options)
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__
        self.__module__ = fn.__module__
        self.__wrapped__ = fn
        registry.register(self)

    def __repr__(self) -> str:
        return f"<runstate task {self.name} on {self.project_name}/{self.mailbox_name}>"

    def __call__(self, *args, **kwargs):
        """Run the function itself, in this process."""
        return self.fn(*args, **kwargs)

    @property
    def key(self) -> tuple[str, str]:
        """Return the registry key: ``(project name, mailbox name)``."""
        return (self.project_name, self.mailbox_name)

    def _make_celery_task(self, celery_options: dict[str, Any]):
        bound = self

        def run(celery_task, task_id: str) -> str:
            from workers.runtime import execute  # its services load with Django's apps, after this module

            return execute(bound, task_id, celery_task.request)

        run.__name__ = self.fn.__name__
        run.__qualname__ = self.fn.__qualname__
        run.__module__ = self.fn.__module__
        run.__doc__ = self.fn.__doc__
        options = {"ignore_result": True, "acks_late": True, **celery_options}
        return shared_task(bind=True, name=self.name, **options)(run)

    # The project and the mailbox, ensured once per process ---------------------------------

    def ids(self) -> tuple[uuid.UUID, uuid.UUID]:
        """Return ``(project id, mailbox id)``, ensuring both on first use in this process."""
        if self._ids is None:
            with self._ids_lock:
                if self._ids is None:
                    from coordination.domain.states import MailboxMode
                    from coordination.services.keys import project_ensure
                    from coordination.services.mailboxes import mailbox_ensure

                    project = project_ensure(name=self.project_name)
                    mailbox, _ = mailbox_ensure(
                        project_id=project.id,
                        name=self.mailbox_name,
                        mode=MailboxMode.WORK,
                        lease_ttl_ms=self.lease_ttl_ms,
                        max_attempts=self.max_attempts,
                    )
                    self._ids = (project.id, mailbox.id)
        return self._ids

    @property
    def project_id(self) -> uuid.UUID:
        """Return the project's id (ensured lazily)."""
        return self.ids()[0]

    def forget_ids(self) -> None:
        """Drop the cached ids (after the database was reset, e.g. between tests)."""
        self._ids = None

    # Submitting ------------------------------------------------------------------------------

    def _project_and_mailbox(self):
        """Return the project id and the mailbox row, read through the process cache where it is on.

        API and worker processes keep mailboxes in ``coordination.plumbing.process_cache``, forgotten
        by NOTIFY when the row changes anywhere; elsewhere (no cache) this is one query.
        """
        from coordination.services.mailboxes import mailbox_get

        _start_process_cache_if_asked()
        project_id, _ = self.ids()
        return project_id, mailbox_get(project_id=project_id, name=self.mailbox_name)

    def validate_input(self, input: object) -> None:
        """Raise ``ValidationFailed`` (400 ``VALIDATION_ERROR``) when ``input`` does not fit the model or schema."""
        from coordination.domain import exceptions

        if self.input_model is not None:
            try:
                self.input_model.model_validate(input)
            except Exception as error:  # noqa: BLE001 - pydantic's ValidationError or the model's own
                errors = getattr(error, "errors", None)
                detail = (
                    "; ".join(
                        f"{'.'.join(str(p) for p in e.get('loc', ())) or 'input'}: {e.get('msg')}" for e in errors()
                    )
                    if callable(errors)
                    else str(error)
                )
                raise exceptions.ValidationFailed(
                    f"Invalid input for {self.name}.", input=detail or "invalid"
                ) from None
        if self._schema_validator is not None:
            problems = sorted(self._schema_validator.iter_errors(input), key=lambda e: list(e.absolute_path))
            if problems:
                detail = "; ".join(
                    f"{'.'.join(str(p) for p in e.absolute_path) or 'input'}: {e.message}" for e in problems
                )
                raise exceptions.ValidationFailed(f"Invalid input for {self.name}.", input=detail)

    def submit(
        self,
        run_id: uuid.UUID | str | Any,
        input: object = None,
        *,
        key: str | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        expires_at: datetime | None = None,
    ):
        """Submit a runstate task under ``run_id``; a Celery worker is woken after commit. Return the Task.

        The same ``key`` with the same input returns the existing task (and sends nothing);
        a run that is a group's gate makes the task a member of that group. The task carries
        the current span's trace context (the ``send`` span's when this process traces): the
        worker's span is its child.
        """
        from coordination.plumbing import tracing
        from coordination.services.tasks import task_submit

        project_id, mailbox = self._project_and_mailbox()
        run_id = uuid.UUID(str(getattr(run_id, "id", run_id)))
        with tracing.send_span(mailbox.name, tracing.TraceContext.current(), run_id=run_id) as (span, trace):
            task, _ = task_submit(
                project_id=project_id,
                mailbox=mailbox,
                run_id=run_id,
                input={} if input is None else input,
                key=key,
                priority=priority,
                max_attempts=max_attempts,
                expires_at=expires_at,
                trace=trace,
            )
            tracing.annotate(span, task_id=task.id, group_id=task.group_id)
        return task

    def submit_many(self, run_id: uuid.UUID | str | Any, inputs: list[object], *, priority: int = 0) -> list:
        """Submit one runstate task per input under ``run_id`` in one transaction, all or nothing; return them.

        The tasks and their events are written by one statement on PostgreSQL, and after
        commit their Celery messages are published in one go (one producer), one per task.
        """
        from coordination.plumbing import tracing
        from coordination.services.tasks import TaskSpec, tasks_submit_many

        project_id, mailbox = self._project_and_mailbox()
        run_id = uuid.UUID(str(getattr(run_id, "id", run_id)))
        with tracing.send_span(mailbox.name, tracing.TraceContext.current(), run_id=run_id) as (_, trace):
            answers = tasks_submit_many(
                project_id=project_id,
                mailbox=mailbox,
                run_id=run_id,
                items=[TaskSpec(input={} if input is None else input, priority=priority) for input in inputs],
                trace=trace,
            )
        return [task for task, _ in answers]

    def kwargs_for(self, input: object) -> dict[str, Any]:
        """Return the input keys the function declares as keyword arguments."""
        if not isinstance(input, dict):
            return {}
        if self.takes_any_kwargs:
            return dict(input)
        return {k: v for k, v in input.items() if k in self.kwarg_names}

    def retry_delay_ms(self, attempt: int) -> int:
        """Return the delay before retrying after failed ``attempt`` (exponential, capped)."""
        return round(min(self.retry_delay * 2 ** max(attempt - 1, 0), self.retry_delay_max) * 1000)


def _schema_validator(schema: dict):
    from jsonschema import validators

    cls = validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def runstate_task(
    fn: Callable | None = None,
    *,
    mailbox: str,
    project: str | None = None,
    lease_ttl: float | None = None,
    max_attempts: int | None = None,
    name: str | None = None,
    input_model: Any = None,
    input_schema: dict | None = None,
    retry_delay: float = 1.0,
    retry_delay_max: float = 300.0,
    **celery_options: Any,
):
    """Turn ``fn(ctx, **input)`` into a Celery task bound to the runstate ``WORK`` mailbox ``mailbox``.

    ``lease_ttl`` (seconds) is the claim's lease, renewed by a heartbeat at a third of it;
    ``max_attempts`` is the mailbox's default. Both update the mailbox when given. An
    exception records a failure and, while attempts remain, a retry after ``retry_delay``
    seconds doubling per attempt up to ``retry_delay_max``. ``input_model`` (a pydantic
    model, or anything with ``model_validate``) or ``input_schema`` (JSON Schema) validate
    input at submit time, whatever the path. Other keywords go to Celery (``queue``,
    ``soft_time_limit``, ``time_limit``, ...); Celery's own retries and ``revoke`` are never used.
    """

    def decorate(function: Callable) -> RunstateTask:
        return RunstateTask(
            function,
            mailbox=mailbox,
            project=project,
            lease_ttl=lease_ttl,
            max_attempts=max_attempts,
            name=name,
            input_model=input_model,
            input_schema=input_schema,
            retry_delay=retry_delay,
            retry_delay_max=retry_delay_max,
            celery_options=celery_options,
        )

    return decorate(fn) if fn is not None else decorate
