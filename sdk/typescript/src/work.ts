/** Tasks, claims and queue messages: tickets, claim and delivery handles, run-bound namespaces. */

import { RunstateError, errorFromItem } from './errors.js';
import { Http, compact, parseTime, segment, wireTime } from './http.js';
import { receiveStarted, recordReceive, sendSpan } from './tracing.js';
import type { ClaimData, DeliveryData, MessageData, TaskData, TaskState } from './types.js';

/** Task states after which nothing changes (DESIGN.md "Tasks and claims"). */
export const TASK_TERMINAL: ReadonlySet<TaskState> = new Set(['SUCCEEDED', 'FAILED', 'CANCELLED', 'EXPIRED']);
/** The server's limits per request (DESIGN.md "HTTP API"). */
export const MAX_SUBMIT_BATCH = 1_000;
export const MAX_CLAIM_BATCH = 500;

export interface WaitTimeout {
  /** How long to wait in all (the SDK loops over the server's 30 s long-polls); `null`: no limit. Default 60 000. */
  timeoutMs?: number | null;
}

/** A handle on one task: the answer of a submit, or `rs.tasks.get(id)` (no request). */
export class Ticket {
  readonly id: string;
  /** The task as last seen (`null` until something loaded it). */
  data: TaskData | null;

  constructor(
    private readonly http: Http,
    id: string,
    data: TaskData | null = null,
  ) {
    this.id = id;
    this.data = data;
  }

  /** Return the task. */
  async status(): Promise<TaskData> {
    const task = await this.http.request<TaskData>('GET', `/tasks/${segment(this.id)}`, { idempotent: true });
    this.data = task;
    return task;
  }

  /** Wait until the task is terminal and return it (whatever its state); `TimeoutError` after `timeoutMs`. */
  async result(options: WaitTimeout = {}): Promise<TaskData> {
    const task = await this.http.wait<TaskData>(`/tasks/${segment(this.id)}/result`, {
      done: (answer) => TASK_TERMINAL.has(answer.state),
      timeoutMs: options.timeoutMs === undefined ? 60_000 : options.timeoutMs,
      what: `Task ${this.id}`,
    });
    this.data = task;
    return task;
  }

  /**
   * Cancel the task: a queued one at once, a running one cooperatively (idempotent).
   *
   * With `graceMs`, the server records `CANCELLED` if the handler has not returned by then.
   */
  async cancel(options: { reason?: string; graceMs?: number } = {}): Promise<TaskData> {
    const task = await this.http.request<TaskData>('POST', `/tasks/${segment(this.id)}/cancel`, {
      idempotent: true,
      body: compact({ reason: options.reason, graceMs: options.graceMs }),
    });
    this.data = task;
    return task;
  }

  /**
   * Submit this finished task again, as a new task in its mailbox and run; return the new ticket.
   *
   * The new task has this one's input unless `input` is given, and its `rerunOf` is this task.
   * With `key` the rerun is idempotent (the same key and input answer the same rerun) and is
   * retried on network errors; without one it is sent once.
   */
  async rerun(options: { key?: string; input?: unknown } = {}): Promise<Ticket> {
    const task = await this.http.request<TaskData>('POST', `/tasks/${segment(this.id)}/rerun`, {
      idempotent: options.key !== undefined,
      body: compact({ key: options.key, input: options.input }),
    });
    return new Ticket(this.http, task.id, task);
  }
}

/** A claimed task under a lease; every operation is fenced by the claim's `attempt`. */
export class Claim {
  readonly id: string;
  readonly attempt: number;
  readonly task: TaskData;
  data: ClaimData;
  leaseExpiresAt: Date | null = null;
  cancellationRequested = false;

  constructor(
    private readonly http: Http,
    data: ClaimData,
  ) {
    this.id = data.claimId;
    this.attempt = data.attempt;
    this.task = data.task;
    this.data = data;
    this.update(data);
  }

  get taskId(): string {
    return this.task.id;
  }

  /** @internal Take a renewal's answer. */
  update(data: Partial<ClaimData>): void {
    this.data = { ...this.data, ...data };
    this.leaseExpiresAt = parseTime(this.data.leaseExpiresAt);
    this.cancellationRequested = Boolean(this.data.cancellationRequested) || this.task.state === 'CANCELLATION_REQUESTED';
  }

  /** Extend the lease; the answer's `cancellationRequested` says whether to stop. */
  async renew(options: { leaseTtlMs?: number } = {}): Promise<ClaimData> {
    const data = await this.http.request<ClaimData>('POST', `/claims/${segment(this.id)}/renew`, {
      idempotent: true,
      body: compact({ leaseTtlMs: options.leaseTtlMs }),
    });
    this.update(data);
    return data;
  }

  /** Record the outcome; the task ends `SUCCEEDED` (`CANCELLED` if cancellation was requested). */
  complete(outcome: unknown = null): Promise<TaskData> {
    return this.http.request<TaskData>('POST', `/claims/${segment(this.id)}/complete`, {
      idempotent: true,
      body: { outcome: outcome === undefined ? null : outcome },
    });
  }

  /** Record a failure; with `retry` the task is queued again while attempts remain. */
  fail(error: unknown = null, options: { retry?: boolean; retryDelayMs?: number } = {}): Promise<TaskData> {
    return this.http.request<TaskData>('POST', `/claims/${segment(this.id)}/fail`, {
      idempotent: true,
      body: { error: error === undefined ? null : error, retry: options.retry ?? false, retryDelayMs: options.retryDelayMs ?? 0 },
    });
  }

  /** Hand the task back to the queue (allowed after the run was cancelled too). */
  release(): Promise<TaskData> {
    return this.http.request<TaskData>('POST', `/claims/${segment(this.id)}/release`, { idempotent: true });
  }
}

/** A queue message handed out under a visibility lease. */
export class Delivery {
  readonly id: string;
  readonly messageId: string;
  readonly body: unknown;
  readonly attempt: number;
  /** When the message becomes visible again unless acknowledged; `extend` moves it. */
  visibleUntil: Date | null;

  constructor(
    private readonly http: Http,
    public data: DeliveryData,
  ) {
    this.id = data.deliveryId;
    this.messageId = data.messageId;
    this.body = data.body;
    this.attempt = data.attempt;
    this.visibleUntil = parseTime(data.visibleUntil);
  }

  /** Acknowledge the message (refused once the run is inactive). */
  complete(): Promise<MessageData> {
    return this.http.request('POST', `/deliveries/${segment(this.id)}/complete`, { idempotent: true });
  }

  /** Put the message back in the queue, visible again after `delayMs`. */
  retry(options: { delayMs?: number } = {}): Promise<MessageData> {
    return this.http.request('POST', `/deliveries/${segment(this.id)}/retry`, {
      idempotent: true,
      body: compact({ delayMs: options.delayMs }),
    });
  }

  /** Dead-letter the message with `reason`. */
  reject(options: { reason?: string } = {}): Promise<MessageData> {
    return this.http.request('POST', `/deliveries/${segment(this.id)}/reject`, {
      idempotent: true,
      body: compact({ reason: options.reason }),
    });
  }

  /**
   * Hide the message `visibilityMs` more from now (100 ms to 24 h). Fenced by this delivery's
   * attempt: `LeaseLostError` once it is stale, the run's code (`ScopeCancelledError`...) once
   * the run is inactive.
   */
  async extend(visibilityMs: number): Promise<DeliveryData> {
    const data = await this.http.request<DeliveryData>('POST', `/deliveries/${segment(this.id)}/extend`, {
      idempotent: true,
      body: { visibilityMs },
    });
    this.data = data;
    this.visibleUntil = parseTime(data.visibleUntil);
    return data;
  }
}

export interface SubmitOptions {
  /** Idempotency key, unique per (mailbox, run): the same key and input answer the existing task. */
  key?: string;
  priority?: number;
  maxAttempts?: number;
  expiresAt?: Date | string;
}

/** One task of `tasks.submitMany`: the input and the options of `tasks.submit`. */
export interface TaskItem extends SubmitOptions {
  input?: unknown;
}

/** One item's answer of `completeMany` or `renewMany`, in the order of the request. */
export interface ClaimResult {
  claimId: string;
  ok: boolean;
  /** The completed task (`completeMany`). */
  task?: TaskData;
  /** The renewed claim, with `cancellationRequested` (`renewMany`). */
  claim?: ClaimData;
  /** The error that item would have thrown alone (`LeaseLostError`, `ScopeCancelledError`...), not thrown. */
  error?: RunstateError;
}

interface BatchAnswerItem {
  claimId: string;
  ok: boolean;
  task?: TaskData;
  claim?: ClaimData;
  error?: unknown;
}

function claimResult(item: BatchAnswerItem): ClaimResult {
  if (!item.ok) return { claimId: item.claimId, ok: false, error: errorFromItem(item.error) };
  const result: ClaimResult = { claimId: item.claimId, ok: true };
  if (item.task !== undefined) result.task = item.task;
  if (item.claim !== undefined) result.claim = item.claim;
  return result;
}

/** Return one task as the API takes it (without `runId`); no input is `{}`. */
export function taskBody(input: unknown, options: SubmitOptions = {}): Record<string, unknown> {
  return {
    ...compact({
      key: options.key,
      priority: options.priority,
      maxAttempts: options.maxAttempts,
      expiresAt: wireTime(options.expiresAt),
    }),
    input: input === undefined || input === null ? {} : input,
  };
}

function needsRun(runId: string | null, what: string): string {
  if (runId === null) throw new Error(`${what} needs a run: use rs.scope(runId).${what}(...).`);
  return runId;
}

function claimIdOf(claim: Claim | string): string {
  return typeof claim === 'string' ? claim : claim.id;
}

/** Tasks of a WORK mailbox: `run.tasks` (submit and claim under the run) or `rs.tasks`. */
export class Tasks {
  constructor(
    private readonly http: Http,
    private readonly runId: string | null,
  ) {}

  /** Return a handle on the task (no request). */
  get(taskId: string): Ticket {
    return new Ticket(this.http, taskId);
  }

  /**
   * Submit a task to `mailbox` under the run and return its ticket.
   *
   * With `key` the submit is idempotent and retried on network errors; without one it is sent once.
   */
  async submit(mailbox: string, input?: unknown, options: SubmitOptions = {}): Promise<Ticket> {
    const body = { runId: needsRun(this.runId, 'tasks.submit'), ...taskBody(input, options) };
    const task = await sendSpan(
      this.http.config.headers,
      mailbox,
      body.runId,
      () =>
        this.http.request<TaskData>('POST', `/mailboxes/${segment(mailbox)}/tasks`, {
          idempotent: options.key !== undefined,
          body,
        }),
      (answer) => ({ task_id: answer.id, group_id: answer.groupId }),
    );
    return new Ticket(this.http, task.id, task);
  }

  /**
   * Submit many tasks to `mailbox` under the run; return their tickets in the order of `items`.
   *
   * Sent 1,000 a request; each request is all or nothing, a longer list is not (the error's
   * `details.index` counts from the start of `items`). A request whose items all have a `key`
   * is retried on network errors.
   */
  async submitMany(mailbox: string, items: Iterable<TaskItem>): Promise<Ticket[]> {
    const runId = needsRun(this.runId, 'tasks.submitMany');
    const bodies = [...items].map((item) => taskBody(item.input, item));
    const tickets: Ticket[] = [];
    for (let offset = 0; offset < bodies.length; offset += MAX_SUBMIT_BATCH) {
      const chunk = bodies.slice(offset, offset + MAX_SUBMIT_BATCH);
      try {
        const answer = await sendSpan(this.http.config.headers, mailbox, runId, () =>
          this.http.request<{ tasks: TaskData[] }>('POST', `/mailboxes/${segment(mailbox)}/tasks/batch`, {
            idempotent: chunk.every((task) => 'key' in task),
            body: { runId, tasks: chunk },
          }),
        );
        tickets.push(...answer.tasks.map((task) => new Ticket(this.http, task.id, task)));
      } catch (error) {
        if (error instanceof RunstateError && offset > 0 && typeof error.details['index'] === 'number') {
          error.details['index'] += offset;
        }
        throw error;
      }
    }
    return tickets;
  }

  /**
   * Claim up to `max` tasks of exactly this run, waiting up to `waitMs` (30 s at most) for one.
   *
   * Never retried: a lost answer's claims are taken over once their lease expires.
   */
  async claim(
    mailbox: string,
    options: { max?: number; waitMs?: number; leaseTtlMs?: number; workerId?: string; signal?: AbortSignal } = {},
  ): Promise<Claim[]> {
    const wait = Math.min(options.waitMs ?? 0, 30_000);
    const runId = needsRun(this.runId, 'tasks.claim');
    const started = receiveStarted();
    const answer = await this.http.request<{ claims: ClaimData[] }>('POST', `/mailboxes/${segment(mailbox)}/claims`, {
      idempotent: false,
      body: compact({
        runId,
        max: options.max ?? 1,
        waitMs: wait,
        leaseTtlMs: options.leaseTtlMs,
        workerId: options.workerId,
      }),
      waitMs: wait,
      signal: options.signal,
    });
    recordReceive(this.http.config.headers, mailbox, runId, started, answer.claims);
    return answer.claims.map((claim) => new Claim(this.http, claim));
  }

  /**
   * Complete many claims: `[claim or claim id, outcome]` pairs; one result per item, in order.
   *
   * Sent 500 a request (`POST /v1/claims/complete`), each item fenced and decided on its own.
   */
  async completeMany(items: Iterable<readonly [Claim | string, unknown]>): Promise<ClaimResult[]> {
    const body = [...items].map(([claim, outcome]) => ({ claimId: claimIdOf(claim), outcome: outcome ?? null }));
    return this.claimBatch('/claims/complete', body);
  }

  /** Renew many claims (or ids), 500 a request (`POST /v1/claims/renew`); a `Claim` passed in is updated. */
  async renewMany(claims: Iterable<Claim | string>, options: { leaseTtlMs?: number } = {}): Promise<ClaimResult[]> {
    const held = [...claims];
    const body = held.map((claim) => compact({ claimId: claimIdOf(claim), leaseTtlMs: options.leaseTtlMs }));
    const results = await this.claimBatch('/claims/renew', body);
    held.forEach((claim, index) => {
      const result = results[index];
      if (typeof claim !== 'string' && result?.claim !== undefined) claim.update(result.claim);
    });
    return results;
  }

  private async claimBatch(path: string, items: Record<string, unknown>[]): Promise<ClaimResult[]> {
    const seen = new Set<unknown>();
    for (const item of items) {
      if (seen.has(item['claimId'])) throw new Error(`Claim ${String(item['claimId'])} appears twice in one batch.`);
      seen.add(item['claimId']);
    }
    const results: ClaimResult[] = [];
    for (let offset = 0; offset < items.length; offset += MAX_CLAIM_BATCH) {
      const answer = await this.http.request<{ results: BatchAnswerItem[] }>('POST', path, {
        idempotent: true,
        body: { items: items.slice(offset, offset + MAX_CLAIM_BATCH) },
      });
      results.push(...answer.results.map(claimResult));
    }
    return results;
  }
}

/** Messages of a QUEUE mailbox: `run.messages` (send and receive under the run) or `rs.messages`. */
export class Messages {
  constructor(
    private readonly http: Http,
    private readonly runId: string | null,
  ) {}

  /** Enqueue a message; with `key` it is idempotent (and retried), without one it is sent once. */
  send(mailbox: string, body: unknown, options: { key?: string } = {}): Promise<MessageData> {
    const runId = needsRun(this.runId, 'messages.send');
    return sendSpan(
      this.http.config.headers,
      mailbox,
      runId,
      () =>
        this.http.request<MessageData>('POST', `/mailboxes/${segment(mailbox)}/messages`, {
          idempotent: options.key !== undefined,
          body: { ...compact({ runId, key: options.key }), body: body ?? null },
        }),
      (message) => ({ message_id: message.id }),
    );
  }

  /** Receive up to `max` messages of exactly this run, waiting up to `waitMs` (30 s at most); never retried. */
  async receive(
    mailbox: string,
    options: { max?: number; visibilityMs?: number; waitMs?: number; signal?: AbortSignal } = {},
  ): Promise<Delivery[]> {
    const wait = Math.min(options.waitMs ?? 0, 30_000);
    const runId = needsRun(this.runId, 'messages.receive');
    const started = receiveStarted();
    const answer = await this.http.request<{ deliveries: DeliveryData[] }>(
      'POST',
      `/mailboxes/${segment(mailbox)}/deliveries`,
      {
        idempotent: false,
        body: compact({
          runId,
          max: options.max ?? 1,
          visibilityMs: options.visibilityMs,
          waitMs: wait,
        }),
        waitMs: wait,
        signal: options.signal,
      },
    );
    recordReceive(this.http.config.headers, mailbox, runId, started, answer.deliveries);
    return answer.deliveries.map((delivery) => new Delivery(this.http, delivery));
  }

  /** Return a message (dead-lettered ones included). */
  retrieve(messageId: string): Promise<MessageData> {
    return this.http.request('GET', `/messages/${segment(messageId)}`, { idempotent: true });
  }
}
