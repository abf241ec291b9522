"""runstate's Python SDK: async and sync clients over the HTTP API, and a worker loop.

    from runstate import AsyncRunstate

    rs = AsyncRunstate()  # RUNSTATE_URL, RUNSTATE_API_KEY
    await rs.mailboxes.ensure("reviews", mode="WORK")
    run = await rs.scopes.create()

``Runstate`` is the sync twin with the same surface. Errors raised by either are the
classes below, all subclasses of ``RunstateError``. This package imports nothing from Django.
"""

from runstate._async.admissions import AsyncAdmission, AsyncAdmissions
from runstate._async.budgets import AsyncBudget, AsyncBudgets, AsyncReservation
from runstate._async.client import AsyncEvents, AsyncMailboxes, AsyncRunstate
from runstate._async.clock import AsyncBarrier, AsyncBarriers, AsyncTimer, AsyncTimers
from runstate._async.consume import AsyncHandler, AsyncWorker
from runstate._async.consume_messages import AsyncMessageHandler, AsyncMessageWorker
from runstate._async.groups import AsyncGroup, AsyncGroups
from runstate._async.hold import AsyncHold, AsyncHoldContext
from runstate._async.pools import AsyncPoolAcquire, AsyncPoolLease, AsyncPools
from runstate._async.quotas import AsyncQuotas
from runstate._async.runs import AsyncScope, AsyncScopes
from runstate._async.work import AsyncClaim, AsyncDelivery, AsyncMessages, AsyncTasks, AsyncTicket
from runstate._batch import ClaimResult, TaskItem
from runstate._config import SDK_VERSION, ClientConfig, JsonDict
from runstate._errors import (
    AuthenticationError,
    BudgetExhaustedError,
    ConflictError,
    DeadlineExceededError,
    LeaseLostError,
    LimitExhaustedError,
    NotFoundError,
    PermissionDeniedError,
    PoolExhaustedError,
    QuotaExhaustedError,
    RateLimitedError,
    RunstateError,
    ScopeCancelledError,
    ScopeCompletedError,
    ScopeInactiveError,
    ServerError,
    ServiceUnavailableError,
    TransportError,
    ValidationError,
)
from runstate._message_worker import AsyncMessageContext, MessageContext, MessageSummary, Reject
from runstate._sync.admissions import Admission, Admissions
from runstate._sync.budgets import Budget, Budgets, Reservation
from runstate._sync.client import Events, Mailboxes, Runstate
from runstate._sync.clock import Barrier, Barriers, Timer, Timers
from runstate._sync.consume import Handler, Worker
from runstate._sync.consume_messages import MessageHandler, MessageWorker
from runstate._sync.groups import Group, Groups
from runstate._sync.hold import Hold, HoldContext
from runstate._sync.pools import PoolAcquire, PoolLease, Pools
from runstate._sync.quotas import Quotas
from runstate._sync.runs import Scope, Scopes
from runstate._sync.work import Claim, Delivery, Messages, Tasks, Ticket
from runstate._worker import AsyncTaskContext, CancellationRequested, ConsumeSummary, TaskContext

__version__ = SDK_VERSION

__all__ = [
    "Admission",
    "Admissions",
    "AsyncAdmission",
    "AsyncAdmissions",
    "AsyncBudget",
    "AsyncBudgets",
    "AsyncQuotas",
    "AsyncReservation",
    "Budget",
    "Budgets",
    "Quotas",
    "Reservation",
    "AsyncBarrier",
    "AsyncBarriers",
    "AsyncClaim",
    "AsyncDelivery",
    "AsyncEvents",
    "AsyncGroup",
    "AsyncGroups",
    "AsyncHandler",
    "AsyncHold",
    "AsyncHoldContext",
    "AsyncMailboxes",
    "AsyncMessageContext",
    "AsyncMessageHandler",
    "AsyncMessageWorker",
    "AsyncMessages",
    "AsyncPoolAcquire",
    "AsyncPoolLease",
    "AsyncPools",
    "AsyncRunstate",
    "AsyncScope",
    "AsyncScopes",
    "AsyncTaskContext",
    "AsyncTasks",
    "AsyncTicket",
    "AsyncTimer",
    "AsyncTimers",
    "AsyncWorker",
    "AuthenticationError",
    "Barrier",
    "BudgetExhaustedError",
    "Barriers",
    "CancellationRequested",
    "Claim",
    "ClaimResult",
    "ClientConfig",
    "ConflictError",
    "ConsumeSummary",
    "DeadlineExceededError",
    "Delivery",
    "Events",
    "Group",
    "Groups",
    "Handler",
    "Hold",
    "HoldContext",
    "JsonDict",
    "LeaseLostError",
    "LimitExhaustedError",
    "Mailboxes",
    "MessageContext",
    "MessageHandler",
    "MessageSummary",
    "MessageWorker",
    "Messages",
    "PoolAcquire",
    "PoolLease",
    "Pools",
    "NotFoundError",
    "PermissionDeniedError",
    "PoolExhaustedError",
    "QuotaExhaustedError",
    "RateLimitedError",
    "Reject",
    "Runstate",
    "RunstateError",
    "Scope",
    "ScopeCancelledError",
    "ScopeCompletedError",
    "ScopeInactiveError",
    "Scopes",
    "ServerError",
    "ServiceUnavailableError",
    "TaskContext",
    "TaskItem",
    "Tasks",
    "Ticket",
    "Timer",
    "Timers",
    "TransportError",
    "ValidationError",
    "Worker",
    "__version__",
]
