/** The JSON shapes the API answers (DESIGN.md "Shapes"), camelCase as on the wire. */

export type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue };

export type MailboxMode = 'WORK' | 'QUEUE';
export type RunState = 'ACTIVE' | 'CANCELLED' | 'COMPLETED';
export type TaskState =
  | 'QUEUED'
  | 'RUNNING'
  | 'SUCCEEDED'
  | 'FAILED'
  | 'CANCELLATION_REQUESTED'
  | 'CANCELLED'
  | 'EXPIRED';
export type GroupCondition = 'FIRST_ACCEPTED' | 'N_ACCEPTED' | 'ALL_TERMINAL';
export type GroupState = 'OPEN' | 'SEALED' | 'FINALIZED';
export type Verdict = 'ACCEPTED' | 'REJECTED';

export interface Mailbox {
  name: string;
  mode: MailboxMode;
  leaseTtlMs: number;
  maxAttempts: number;
  createdAt: string;
}

export interface RunData {
  id: string;
  name: string | null;
  parentId: string | null;
  storedState: RunState;
  effective: 'ACTIVE' | 'INACTIVE';
  inactiveReason: 'CANCELLED' | 'COMPLETED' | 'DEADLINE_EXCEEDED' | null;
  inactiveRunId: string | null;
  deadline: string | null;
  childLimit: number;
  createdAt: string;
  endedAt: string | null;
  cancelReason: string | null;
}

export interface TaskData {
  id: string;
  mailbox: string;
  runId: string;
  key: string | null;
  input: JsonValue;
  state: TaskState;
  /** What the handler returned (any JSON value). */
  outcome: unknown;
  /** Whatever JSON value was given to `claim.fail(error)`; the service's own are `{code, message}`. */
  error: unknown;
  attempts: number;
  maxAttempts: number;
  priority: number;
  groupId: string | null;
  createdAt: string;
  startedAt: string | null;
  finishedAt: string | null;
  cancelReason: string | null;
  /** The task this one reruns (`ticket.rerun()`); null unless a rerun. */
  rerunOf: string | null;
}

/** A member submit or join answers the task and the group's state after it. */
export interface MemberData extends TaskData {
  groupState: GroupState;
}

export interface ClaimData {
  claimId: string;
  attempt: number;
  leaseExpiresAt: string;
  cancellationRequested?: boolean;
  task: TaskData;
  /** The submitter's W3C `traceparent` (`null` when it sent none); the worker's `process` span is its child. */
  traceparent?: string | null;
  /** The submitter's W3C `tracestate` (`null` when it sent none). */
  tracestate?: string | null;
}

export interface MessageData {
  id: string;
  mailbox: string;
  runId: string;
  key: string | null;
  body: JsonValue;
  /** `QUEUED`, `IN_FLIGHT`, `COMPLETED`, `DEAD_LETTERED` or `CANCELLED`. */
  state: string;
  attempts: number;
  createdAt: string;
  /** When it can be received (again). */
  visibleAt: string | null;
  finishedAt: string | null;
  /** Why it was dead-lettered: a `reject`'s reason, or `max_attempts` (delivered the mailbox's `maxAttempts` times). */
  deadLetterReason: string | null;
}

export interface DeliveryData {
  deliveryId: string;
  messageId: string;
  body: JsonValue;
  attempt: number;
  visibleUntil: string | null;
  /** The sender's W3C `traceparent` (`null` when it sent none); the message loop's `process` span is its child. */
  traceparent?: string | null;
  /** The sender's W3C `tracestate` (`null` when it sent none). */
  tracestate?: string | null;
}

export interface GroupMember {
  taskId: string;
  key: string | null;
  state: TaskState;
  verdict: Verdict | null;
  late: boolean;
  verdictAt: string | null;
}

export interface GroupData {
  id: string;
  scopeId: string;
  parentScopeId: string | null;
  mailbox: string;
  condition: GroupCondition;
  threshold: number | null;
  expectedMembers: number | null;
  deadline: string | null;
  state: GroupState;
  outcome: 'SUCCESS' | 'FAILURE' | null;
  outcomeReason: string | null;
  createdAt: string;
  closedAt: string | null;
  finalizedAt: string | null;
  members: GroupMember[];
}

export interface GroupDecision {
  state: GroupState;
  outcome: 'SUCCESS' | 'FAILURE' | null;
  outcomeReason: string | null;
}

export interface VerdictData {
  taskId: string;
  verdict: Verdict;
  late: boolean;
  groupState: GroupState;
  outcome: 'SUCCESS' | 'FAILURE' | null;
  outcomeReason: string | null;
}

export interface BarrierData {
  id: string;
  runId: string;
  name: string | null;
  target: number;
  epoch: number;
  arrivals: number;
  state: 'WAITING' | 'RELEASED' | 'CANCELLED';
  releasedAt: string | null;
}

export interface TimerData {
  id: string;
  runId: string;
  state: 'ARMED' | 'FIRED' | 'ACKNOWLEDGED' | 'CANCELLED';
  fireAt: string;
  firedAt: string | null;
  acknowledgedAt: string | null;
  createdAt: string;
}

export interface EventData {
  id: string;
  type: string;
  runId: string;
  subjectId: string | null;
  data: Record<string, unknown>;
  createdAt: string;
}

export interface EventPage {
  events: EventData[];
  nextCursor: string;
}

export interface Page<T> {
  results: T[];
  nextCursor: string | null;
}
