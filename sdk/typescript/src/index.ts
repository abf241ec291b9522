/**
 * `@runstate/client`: the TypeScript client of runstate, and worker loops (tasks and queue
 * messages) whose handlers get an `AbortSignal` that aborts on cancellation.
 *
 *     import { Runstate } from '@runstate/client';
 *
 *     const rs = new Runstate(); // RUNSTATE_URL, RUNSTATE_API_KEY
 *     await rs.mailboxes.ensure('reviews', { mode: 'WORK' });
 *     const run = await rs.scopes.create();
 */

export {
  Admission,
  Admissions,
  type AdmissionConfigData,
  type AdmissionData,
  type AdmissionRequestOptions,
  type AdmissionState,
} from './admissions.js';
export { Budget, Budgets, Reservation, type BudgetData, type ReservationData, type ReserveOptions } from './budgets.js';
export { Events, Mailboxes, Runstate, type EventFilter } from './client.js';
export { HandlerContext, type LoopLog, type LoopOptions, type LoopSummary } from './loop.js';
export { Barrier, Barriers, Timer, Timers, type ArmedTimer, type FiredTimer } from './clock.js';
export {
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
  TimeoutError,
  TransportError,
  ValidationError,
  type ErrorDetails,
} from './errors.js';
export { Group, Groups, type GroupCreateOptions } from './groups.js';
export {
  MessageContext,
  MessageWorker,
  Reject,
  type MessageConsumeOptions,
  type MessageHandler,
  type MessageSummary,
} from './message-worker.js';
export {
  PoolLease,
  Pools,
  type AcquireOptions,
  type LeaseLossReason,
  type PoolData,
  type PoolLeaseData,
  type PoolLeaseState,
} from './pools.js';
export { SDK_VERSION, type ClientConfig, type RunstateOptions } from './http.js';
export { Quotas, type QuotaData, type QuotaTake, type QuotaTakeOptions } from './quotas.js';
export { Scope, Scopes, type RunCreateOptions } from './scopes.js';
export type * from './types.js';
export {
  Claim,
  Delivery,
  Messages,
  Tasks,
  Ticket,
  type ClaimResult,
  type SubmitOptions,
  type TaskItem,
  type WaitTimeout,
} from './work.js';
export {
  TaskContext,
  Worker,
  describeError,
  task,
  type ConsumeOptions,
  type ConsumeSummary,
  type Handler,
  type Schema,
  type StopReason,
  type TaskDefinition,
} from './worker.js';
