/** Runs (scopes): `rs.scopes.create`, `rs.scope(id)` and the run handle. */

import { Admissions } from './admissions.js';
import { Budgets } from './budgets.js';
import { Barriers, Timers } from './clock.js';
import { Groups } from './groups.js';
import { Http, compact, segment, wireTime } from './http.js';
import type { Page, RunData, RunState } from './types.js';
import { MessageWorker, type MessageConsumeOptions, type MessageHandler, type MessageSummary } from './message-worker.js';
import { Messages, Tasks } from './work.js';
import { Worker, type ConsumeOptions, type ConsumeSummary, type Handler, type TaskDefinition } from './worker.js';

export interface RunCreateOptions {
  /** A label; runs are never looked up by name. */
  name?: string;
  /** Refuse new work with `DEADLINE_EXCEEDED` from then on (must be in the future). */
  deadline?: Date | string;
  /** How many child runs this run may have (default 1000). */
  childLimit?: number;
}

/**
 * A handle on a run; making one (`rs.scope(id)`) sends no request.
 *
 * `groups`, `barriers`, `timers`, `tasks` and `messages` create and find objects under this run;
 * `consume` runs a worker loop on it, `consumeMessages` a message loop. `data` is the run as last seen.
 */
export class Scope {
  readonly id: string;
  data: RunData | null;
  readonly groups: Groups;
  readonly barriers: Barriers;
  readonly timers: Timers;
  readonly tasks: Tasks;
  readonly messages: Messages;
  readonly admissions: Admissions;
  readonly budgets: Budgets;

  constructor(
    private readonly http: Http,
    id: string,
    data: RunData | null = null,
  ) {
    this.id = id;
    this.data = data;
    this.groups = new Groups(http);
    this.barriers = new Barriers(http, id);
    this.timers = new Timers(http, id);
    this.tasks = new Tasks(http, id);
    this.messages = new Messages(http, id);
    this.admissions = new Admissions(http, id);
    this.budgets = new Budgets(http, id);
  }

  private get path(): string {
    return `/runs/${segment(this.id)}`;
  }

  /** Return the run: `storedState` (its own) and `effective` (`INACTIVE` if it or an ancestor ended). */
  async status(): Promise<RunData> {
    this.data = await this.http.request<RunData>('GET', this.path, { idempotent: true });
    return this.data;
  }

  /** Cancel the run and everything below it (idempotent; `SCOPE_COMPLETED` on a completed run). */
  async cancel(options: { reason?: string } = {}): Promise<RunData> {
    this.data = await this.http.request<RunData>('POST', `${this.path}/cancel`, {
      idempotent: true,
      body: compact({ reason: options.reason }),
    });
    return this.data;
  }

  /** Complete the run and everything below it (idempotent; `SCOPE_CANCELLED` on a cancelled run). */
  async complete(): Promise<RunData> {
    this.data = await this.http.request<RunData>('POST', `${this.path}/complete`, { idempotent: true });
    return this.data;
  }

  /** Create a child run, cancelled along with this one (never retried: two calls make two runs). */
  async child(options: RunCreateOptions = {}): Promise<Scope> {
    const run = await this.http.request<RunData>('POST', `${this.path}/children`, {
      idempotent: false,
      body: compact({ name: options.name, deadline: wireTime(options.deadline), childLimit: options.childLimit }),
    });
    return new Scope(this.http, run.id, run);
  }

  /** Return a worker loop on this run (start it with `run()`, end it with `stop()`); see `consume`. */
  worker<I = unknown>(mailbox: string, handler: Handler<I> | TaskDefinition<I>, options: ConsumeOptions = {}): Worker {
    return new Worker(this.http, this.id, mailbox, handler, options);
  }

  /**
   * Claim this run's tasks of `mailbox` and run `handler(context)` on each, `concurrency` at a time.
   *
   * Leases are renewed in the background (batched). A return records the outcome (`CANCELLED`
   * after a cancel request), a throw a failure (retried while attempts remain; `FAILED` after a
   * cancel request). `context.signal` aborts when cancellation is requested, the lease is lost or
   * the run refuses work. Resolves with a summary when the run refuses work (cancelled, completed,
   * past its deadline) or on `SIGTERM` / `stop()` / the `signal` option: running handlers get
   * `drainTimeoutMs` to finish, then their tasks are released.
   */
  consume<I = unknown>(
    mailbox: string,
    handler: Handler<I> | TaskDefinition<I>,
    options: ConsumeOptions = {},
  ): Promise<ConsumeSummary> {
    return this.worker(mailbox, handler, options).run();
  }

  /** Return a message loop on this run (start it with `run()`, end it with `stop()`); see `consumeMessages`. */
  messageWorker<B = unknown>(mailbox: string, handler: MessageHandler<B>, options: MessageConsumeOptions = {}): MessageWorker {
    return new MessageWorker(this.http, this.id, mailbox, handler, options);
  }

  /**
   * Receive this run's messages of the QUEUE `mailbox` and run `handler(context)` on each, `concurrency` at a time.
   *
   * Each delivery is hidden for `visibilityMs` (default: the mailbox's `leaseTtlMs`) and
   * extended in the background every `extendFraction` of it while the handler runs. A return
   * acknowledges the message; a throw puts it back, visible again after `retryDelayMs`; a
   * `Reject(reason)` dead-letters it. `context.signal` aborts and `context.isLost()` is true
   * when the delivery is lost (an extend or the answer refused with the run's code or
   * `LEASE_LOST`): nothing more is sent for it. Resolves with a summary when the run refuses
   * work (cancelled, completed, past its deadline) or on `SIGTERM` / `stop()` / the `signal`
   * option: running handlers get `drainTimeoutMs` to finish, then their messages are put back.
   */
  consumeMessages<B = unknown>(
    mailbox: string,
    handler: MessageHandler<B>,
    options: MessageConsumeOptions = {},
  ): Promise<MessageSummary> {
    return this.messageWorker(mailbox, handler, options).run();
  }
}

/** `rs.scopes`: create and list runs. */
export class Scopes {
  constructor(private readonly http: Http) {}

  /** Create a run (a root run, or a child of `parentId`); never retried: two calls make two runs. */
  async create(options: RunCreateOptions & { parentId?: string } = {}): Promise<Scope> {
    const run = await this.http.request<RunData>('POST', '/runs', {
      idempotent: false,
      body: compact({
        name: options.name,
        deadline: wireTime(options.deadline),
        parentId: options.parentId,
        childLimit: options.childLimit,
      }),
    });
    return new Scope(this.http, run.id, run);
  }

  /** Return one page of runs, oldest first: `{ results, nextCursor }`. */
  list(options: { parentId?: string; state?: RunState; cursor?: string; limit?: number } = {}): Promise<Page<RunData>> {
    return this.http.request('GET', '/runs', {
      idempotent: true,
      query: { parentId: options.parentId, state: options.state, cursor: options.cursor, limit: options.limit },
    });
  }
}
