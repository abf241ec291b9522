/**
 * The error classes of the SDK and the mapping from an HTTP error answer to them.
 *
 * Every error the service answers carries `{"error": {"code", "message", "details"}}`; the
 * status picks the class and, for a 409, the `code` picks the subclass (as in the Python SDK).
 */

export type ErrorDetails = Record<string, unknown>;

export interface RunstateErrorOptions {
  code?: string;
  status?: number | null;
  details?: ErrorDetails;
  cause?: unknown;
}

/** Base of every error thrown by the SDK: `code` is the service's stable code, `status` the HTTP status. */
export class RunstateError extends Error {
  readonly code: string;
  /** The HTTP status, or `null` when no answer arrived (or for one item of a batch answer). */
  readonly status: number | null;
  details: ErrorDetails;

  constructor(message: string, options: RunstateErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.code = options.code ?? 'ERROR';
    this.status = options.status ?? null;
    this.details = options.details ?? {};
  }
}

/** No answer arrived: the connection failed or timed out (after retries, when allowed). */
export class TransportError extends RunstateError {}

/** 400 `VALIDATION_ERROR`: the request is malformed (`details` names the fields). */
export class ValidationError extends RunstateError {}

/** 401 `UNAUTHENTICATED`: no key, or an invalid, revoked or expired key. */
export class AuthenticationError extends RunstateError {}

/** 403 `PERMISSION_DENIED`: the key lacks the permission for this operation. */
export class PermissionDeniedError extends RunstateError {}

/** 404 `NOT_FOUND`: unknown, another project's, or outside a bound key's run. */
export class NotFoundError extends RunstateError {}

/** 409: the request is well formed but the object's state refuses it (see `code`). */
export class ConflictError extends RunstateError {}

/** 409: the run (or an ancestor) refuses new work: cancelled, completed or past its deadline. */
export class ScopeInactiveError extends ConflictError {}

/** 409 `SCOPE_CANCELLED`: the run or an ancestor is cancelled. */
export class ScopeCancelledError extends ScopeInactiveError {}

/** 409 `SCOPE_COMPLETED`: the run or an ancestor is completed. */
export class ScopeCompletedError extends ScopeInactiveError {}

/** 409 `DEADLINE_EXCEEDED`: the run or an ancestor is past its deadline. */
export class DeadlineExceededError extends ScopeInactiveError {}

/** 409 `LEASE_LOST`: the claim or delivery no longer holds its task or message. */
export class LeaseLostError extends ConflictError {}

/** 409: a shared limit has no room now (`details` says how much there is). */
export class LimitExhaustedError extends ConflictError {}

/** 409 `POOL_EXHAUSTED`: not granted in time (`details`: capacity, inUse, waiting). */
export class PoolExhaustedError extends LimitExhaustedError {}

/** 409 `QUOTA_EXHAUSTED`: the tokens are not there (`details.retryAfterMs`: when they will be). */
export class QuotaExhaustedError extends LimitExhaustedError {}

/** 409 `BUDGET_EXHAUSTED`: a budget of the chain lacks room (`details.remaining`). */
export class BudgetExhaustedError extends LimitExhaustedError {}

/** 429 `RATE_LIMITED`; `retryAfterMs` is the server's `Retry-After` hint, if any. */
export class RateLimitedError extends RunstateError {
  retryAfterMs: number | null = null;
}

/** 503 `SERVICE_UNAVAILABLE`: a dependency of the service (the database) is down. */
export class ServiceUnavailableError extends RunstateError {}

/** Any other 5xx answer (`INTERNAL`, or a proxy's 502/504). */
export class ServerError extends RunstateError {}

/** A wait (`ticket.result`, `group.wait`, `barrier.wait`, `timer.wait`) ran past the caller's `timeoutMs`. */
export class TimeoutError extends RunstateError {
  /** The object as last seen by the wait. */
  readonly last: unknown;

  constructor(message: string, last: unknown) {
    super(message, { code: 'TIMEOUT' });
    this.last = last;
  }
}

type ErrorClass = new (message: string, options?: RunstateErrorOptions) => RunstateError;

// The codes DESIGN.md lists under 409, each with the class that represents it.
const CONFLICT_CLASSES: Record<string, ErrorClass> = {
  SCOPE_CANCELLED: ScopeCancelledError,
  SCOPE_COMPLETED: ScopeCompletedError,
  DEADLINE_EXCEEDED: DeadlineExceededError,
  LEASE_LOST: LeaseLostError,
  POOL_EXHAUSTED: PoolExhaustedError,
  QUOTA_EXHAUSTED: QuotaExhaustedError,
  BUDGET_EXHAUSTED: BudgetExhaustedError,
};
const KNOWN_CONFLICTS = new Set([
  ...Object.keys(CONFLICT_CLASSES),
  'CHILD_LIMIT_REACHED',
  'KEY_CONFLICT',
  'MAILBOX_MODE_CONFLICT',
  'GROUP_CLOSED',
  'GROUP_FINALIZED',
  'GROUP_FULL',
  'TASK_NOT_SUCCEEDED',
  'TASK_NOT_FINISHED',
  'VERDICT_CONFLICT',
  'BARRIER_RELEASED',
  'BARRIER_CANCELLED',
  'BARRIER_NOT_RELEASED',
  'TIMER_FIRED',
  'INVALID_STATE',
]);
// The other codes name their class whatever the status (a 413 is a `VALIDATION_ERROR` too).
const CODE_CLASSES: Record<string, ErrorClass> = {
  VALIDATION_ERROR: ValidationError,
  UNAUTHENTICATED: AuthenticationError,
  PERMISSION_DENIED: PermissionDeniedError,
  NOT_FOUND: NotFoundError,
  RATE_LIMITED: RateLimitedError,
  SERVICE_UNAVAILABLE: ServiceUnavailableError,
};
const STATUS_CLASSES: Record<number, ErrorClass> = {
  400: ValidationError,
  401: AuthenticationError,
  403: PermissionDeniedError,
  404: NotFoundError,
  409: ConflictError,
  429: RateLimitedError,
  503: ServiceUnavailableError,
};

/**
 * Return the class of an error `code` answered with `status` (`null`: one item of a batch).
 *
 * A 409 picks its class by code (`ConflictError` for a code it does not know); any other answer
 * by its code when the code is known, else by its status.
 */
export function errorClass(code: string, status: number | null): ErrorClass {
  if (status === 409 || (status === null && KNOWN_CONFLICTS.has(code))) {
    return CONFLICT_CLASSES[code] ?? ConflictError;
  }
  const byCode = CODE_CLASSES[code];
  if (byCode !== undefined) return byCode;
  if (status === null) return RunstateError;
  return STATUS_CLASSES[status] ?? (status >= 500 ? ServerError : RunstateError);
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** Build the error of one refused item of a batch answer (`{code, message}`); `status` is `null`. */
export function errorFromItem(error: unknown): RunstateError {
  const fields = isRecord(error) ? error : {};
  const code = typeof fields['code'] === 'string' && fields['code'] ? fields['code'] : 'ERROR';
  const message = typeof fields['message'] === 'string' && fields['message'] ? fields['message'] : code;
  const Class = errorClass(code, null);
  return new Class(message, { code, details: isRecord(fields['details']) ? fields['details'] : {} });
}

/** Return `Retry-After` in milliseconds, when it is a number of seconds. */
export function retryAfterMs(headers: Headers): number | null {
  const value = headers.get('retry-after');
  if (value === null || value.trim() === '') return null;
  const seconds = Number(value);
  return Number.isFinite(seconds) ? Math.max(0, seconds * 1000) : null;
}

/** Build the error that represents an error answer (status >= 400) from its status, headers and body text. */
export function errorFromResponse(status: number, statusText: string, headers: Headers, text: string): RunstateError {
  let code = `HTTP_${status}`;
  let message = statusText || `HTTP ${status}`;
  let details: ErrorDetails = {};
  let body: unknown = null;
  try {
    body = JSON.parse(text);
  } catch {
    body = null;
  }
  const error = isRecord(body) ? body['error'] : undefined;
  if (isRecord(error)) {
    if (typeof error['code'] === 'string' && error['code']) code = error['code'];
    if (typeof error['message'] === 'string' && error['message']) message = error['message'];
    if (isRecord(error['details'])) details = error['details'];
  }
  const Class = errorClass(code, status);
  const exc = new Class(message, { code, status, details });
  if (exc instanceof RateLimitedError) exc.retryAfterMs = retryAfterMs(headers);
  return exc;
}
