/**
 * The worker loop behind `scope.consume`: claim, renew leases in the background (batched),
 * run handlers, record their results (completions batched), stop.
 *
 * A JavaScript promise cannot be cancelled: a handler is told to stop through
 * `context.signal`, an `AbortSignal` that aborts when cancellation is requested, when the lease
 * is lost, when the run refuses work, or when the worker gives up on it while stopping. Pass it
 * to `fetch` and other I/O so that work in flight rejects at once.
 *
 * The signal aborts as soon as the server pushes what stops the claim, over the claim watch
 * (`watch.ts`, one connection per worker); renewal reports the same, later, while it is down.
 *
 * The fetch loop, stopping (`SIGTERM`, `stop()`, draining) and the context's signal are
 * `loop.ts`'s, shared with the message loop (`message-worker.ts`).
 *
 * With `@opentelemetry/api` installed and a tracer provider registered, each handler runs in
 * a `process` span, the child of the submitter's (the claim's `traceparent`), and recording
 * its result is a `settle` span under it (`tracing.ts`).
 */

import { hostname } from 'node:os';

import { RunstateError, ScopeInactiveError } from './errors.js';
import { Http, sleep } from './http.js';
import {
  FetchLoop,
  HandlerContext,
  MIN_RENEW_INTERVAL_MS,
  freshHeld,
  isExpectedRefusal,
  isTransient,
  settle,
  type HeldItem,
  type Settled,
  type LoopOptions,
  type LoopSummary,
} from './loop.js';
import { ProcessSpan } from './tracing.js';
import type { TaskData } from './types.js';
import { ClaimWatch, READY_TIMEOUT_MS } from './watch.js';
import { Claim, MAX_CLAIM_BATCH, Tasks, type ClaimResult } from './work.js';

export type { StopReason } from './loop.js';

// The server's cap on `max` of one claim call: a worker with more free slots fills them in several calls.
const MAX_CLAIMS_PER_CALL = 100;

// Why a pushed event stops a claim, as renewal would say it: the run refused (cancelled,
// completed, past its deadline), else the claim is gone.
const SCOPE_CAUSES = new Set(['run_cancelled', 'run_completed', 'run_deadline']);

// Pushed events of claims not started yet (the watch's frame came before the claim call's
// answer), kept for them; the oldest are dropped past this many.
const EARLY_EVENTS_MAX = 10_000;

type Pushed = { type: string; data: Record<string, unknown> };

/** What a handler gets: the claimed task, and whether (and why) it should stop. */
export class TaskContext<I = unknown> extends HandlerContext {
  /** The task's input (parsed by the task's `schema`, when it has one). */
  readonly input: I;
  readonly task: TaskData;
  readonly taskId: string;
  readonly claimId: string;
  /** 1 for the first claim of the task, 2 after a retry or a takeover... */
  readonly attempt: number;
  readonly key: string | null;
  // `signal` aborts when cancellation is requested, the lease is lost, the run refuses work, or
  // the worker gives up; `isCancellationRequested` and `throwIfCancellationRequested` are bound
  // to the context, so a handler may destructure them (see HandlerContext).

  /** @internal */
  constructor(claim: Claim, input: I) {
    super(`task ${claim.taskId}`);
    this.task = claim.task;
    this.taskId = claim.taskId;
    this.claimId = claim.id;
    this.attempt = claim.attempt;
    this.key = claim.task.key;
    this.input = input;
  }
}

/** A plain handler: its return value is the outcome, a throw a failure. */
export type Handler<I = unknown> = (context: TaskContext<I>) => unknown;

/** Anything with `parse()` that returns the input or throws (a zod schema, for example). */
export interface Schema<T> {
  parse(input: unknown): T;
}

/** A task definition for `consume`, as Runlane's `task()` describes one. */
export interface TaskDefinition<I = unknown> {
  readonly id: string;
  /** Validates and converts the input; a throw records a failure that is not retried. */
  readonly schema?: Schema<I> | undefined;
  run(input: I, context: TaskContext<I>): unknown;
}

const TASK_DEFINITION = Symbol.for('@runstate/client.task');

/**
 * Define a task handler with an optional input validator: `task({ id, schema?, run })`.
 *
 * `schema` is any object with `parse()` (zod, valibot's wrappers, your own): the SDK does not
 * depend on any of them. Pass the result to `scope.consume(mailbox, definition)`.
 */
export function task<I = unknown>(definition: TaskDefinition<I>): TaskDefinition<I> {
  if (typeof definition.run !== 'function') throw new TypeError('task() needs a run(input, context) function.');
  return Object.freeze({ ...definition, [TASK_DEFINITION]: true });
}

function isDefinition(value: unknown): value is TaskDefinition<unknown> {
  return typeof value === 'object' && value !== null && typeof (value as TaskDefinition).run === 'function';
}

/** What a worker loop did before it resolved. */
export interface ConsumeSummary extends LoopSummary {
  /** Outcomes recorded (`SUCCEEDED`, or `CANCELLED` when cancellation was requested). */
  completed: number;
  /** Failures recorded. */
  failed: number;
  /** Claims lost (lease lost, run refused, or the record refused). */
  lost: number;
  /** Tasks handed back when stopping. */
  released: number;
  /** `"stopped"` (`stop()`, `SIGTERM`, the `signal` option) or the run's refusal code (`SCOPE_CANCELLED`...). */
  stopReason: string;
}

/** `concurrency`, `drainTimeoutMs`, `handleSignals`, `signal` and `log` (see `LoopOptions`), and: */
export interface ConsumeOptions extends LoopOptions {
  /** The lease of each claim (default: the mailbox's `leaseTtlMs`). */
  leaseTtlMs?: number;
  workerId?: string;
  /** How long one claim request may wait for work (30 000 at most, the default). */
  claimWaitMs?: number;
  /** Renew leases every this fraction of their TTL (default 1/3). */
  renewFraction?: number;
}

interface Held extends HeldItem {
  readonly claim: Claim;
  readonly context: TaskContext<unknown>;
  leaseUntil: number;
  /** The handler's `process` span (`null` when nothing traces). */
  readonly span: ProcessSpan | null;
}

/** Return the failure record of a handler's error. */
export function describeError(error: unknown): Record<string, unknown> {
  if (error instanceof Error) {
    return { type: error.name, message: error.message, stack: (error.stack ?? '').slice(-4000) };
  }
  return { type: typeof error, message: String(error) };
}

/** A worker loop on one run and mailbox: `await worker.run()`; `worker.stop()` ends it. */
export class Worker extends FetchLoop<Claim, Held, ConsumeSummary> {
  readonly workerId: string;
  readonly summary: ConsumeSummary = { completed: 0, failed: 0, lost: 0, released: 0, stopReason: '' };
  private readonly tasks: Tasks;
  private readonly handler: Handler<unknown> | TaskDefinition<unknown>;
  private readonly leaseTtlMs: number | undefined;
  private readonly claimWaitMs: number;
  private readonly renewFraction: number;
  private batchRenew = true;
  private batchComplete = true;
  private pendingCompletes: { claim: Claim; outcome: unknown; settle: (result: ClaimResult) => void }[] = [];
  private readonly watch: ClaimWatch;
  private readonly early = new Map<string, Pushed>();

  constructor(
    http: Http,
    runId: string,
    mailbox: string,
    handler: Handler<any> | TaskDefinition<any>,
    options: ConsumeOptions = {},
  ) {
    const claimWaitMs = Math.max(0, Math.min(options.claimWaitMs ?? 30_000, 30_000));
    super(http, runId, mailbox, options, { leaseMs: options.leaseTtlMs, fetchWaitMs: claimWaitMs });
    const renewFraction = options.renewFraction ?? 1 / 3;
    if (!(renewFraction > 0 && renewFraction < 1)) throw new RangeError('renewFraction must be between 0 and 1');
    this.tasks = new Tasks(http, runId);
    this.handler = handler;
    this.leaseTtlMs = options.leaseTtlMs;
    this.workerId = options.workerId ?? `${hostname()}:${process.pid}:${Math.random().toString(16).slice(2, 10)}`;
    this.claimWaitMs = claimWaitMs;
    this.renewFraction = renewFraction;
    this.watch = new ClaimWatch(http, this.workerId, (type, claimId, data) => this.pushed(type, claimId, data), this.log);
  }

  protected override async background(signal: AbortSignal): Promise<void> {
    await Promise.all([this.renewLoop(signal), this.watch.run(signal)]);
  }

  /** Claims taken before the watch opens hear a cancel at renewal only: wait for it, briefly. */
  protected override async ready(): Promise<void> {
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([this.watch.ready, new Promise<void>((resolve) => (timer = setTimeout(resolve, READY_TIMEOUT_MS)))]);
    clearTimeout(timer);
  }

  /** Apply what the claim watch says of one claim, as its renewal would say it later. */
  private pushed(type: string, claimId: string, data: Record<string, unknown>): void {
    const held = this.held.get(claimId);
    if (held === undefined) {
      // Not started yet (its claim call's answer is still on its way), or not ours (another
      // loop with the same worker id, or a handler that returned): kept for `start`.
      this.early.set(claimId, { type, data });
      if (this.early.size > EARLY_EVENTS_MAX) this.early.delete(this.early.keys().next().value as string);
      return;
    }
    this.stopPushed(held, { type, data });
  }

  private stopPushed(held: Held, { type, data }: Pushed): void {
    if (held.lost || held.recording || held.abandoned) return;
    if (type === 'task.cancellation_requested') held.context.trip('cancellation_requested');
    else this.lose(held, SCOPE_CAUSES.has(String(data.cause)) ? 'scope_refused' : 'lease_lost');
  }

  protected fetch(max: number, signal: AbortSignal): Promise<Claim[]> {
    return this.tasks.claim(this.mailbox, {
      max: Math.min(max, MAX_CLAIMS_PER_CALL),
      waitMs: this.claimWaitMs,
      workerId: this.workerId,
      signal,
      ...(this.leaseTtlMs === undefined ? {} : { leaseTtlMs: this.leaseTtlMs }),
    });
  }

  protected handBack(claim: Claim): Promise<void> {
    return this.release(claim);
  }

  protected abandon(held: Held): Promise<void> {
    return this.release(held.claim);
  }

  protected label(held: Held): string {
    return `task ${held.claim.taskId}: claim`;
  }

  // Running one task -------------------------------------------------------------------------

  protected start(claim: Claim): void {
    let input: unknown = claim.task.input;
    let invalid: unknown = undefined;
    const definition = isDefinition(this.handler) ? this.handler : null;
    if (definition?.schema !== undefined) {
      try {
        input = definition.schema.parse(claim.task.input);
      } catch (error) {
        invalid = error ?? new Error('invalid input');
      }
    }
    const context = new TaskContext<unknown>(claim, input);
    const held: Held = {
      claim,
      context,
      leaseUntil: Date.now() + this.leaseMs,
      span: ProcessSpan.start(this.mailbox, {
        traceparent: claim.data.traceparent,
        tracestate: claim.data.tracestate,
        runId: this.runId,
        taskId: claim.taskId,
        attempt: claim.attempt,
        groupId: claim.task.groupId,
      }),
      ...freshHeld(),
    };
    this.held.set(claim.id, held);
    if (claim.cancellationRequested) context.trip('cancellation_requested');
    held.done = this.supervise(held, definition, invalid);
    const early = this.early.get(claim.id);
    if (early !== undefined) {
      this.early.delete(claim.id);
      this.stopPushed(held, early);
    }
  }

  private async supervise(held: Held, definition: TaskDefinition<unknown> | null, invalid: unknown): Promise<void> {
    try {
      if (invalid !== undefined) {
        held.recording = true;
        const error = { ...describeError(invalid), type: 'InputValidationError' };
        held.span?.fail(invalid);
        await this.record(held, 'fail', () => held.claim.fail(error, { retry: false }), true);
        return;
      }
      const handler = this.handler;
      const call = (): Promise<Settled> =>
        settle(() => (definition ? definition.run(held.context.input, held.context) : (handler as Handler)(held.context)));
      const running = held.span ? held.span.run(call) : call();
      const settled = await Promise.race([running, held.dropped.then(() => null)]);
      if (settled === null || held.lost || held.abandoned) {
        // The claim is gone (counted by lose()) or released by shutdown(): the result cannot count.
        return;
      }
      held.recording = true;
      if (!settled.ok) {
        this.log('warn', `task ${held.claim.taskId} attempt ${held.claim.attempt} failed: ${String(settled.error)}`);
        held.span?.fail(settled.error);
        await this.record(held, 'fail', () => held.claim.fail(describeError(settled.error), { retry: true }), true);
        return;
      }
      const outcome = settled.value === undefined ? null : settled.value;
      try {
        JSON.stringify(outcome);
      } catch (error) {
        const message = `The handler's return value is not JSON: ${String(error)}`;
        held.span?.fail(error);
        await this.record(held, 'fail', () => held.claim.fail({ type: 'TypeError', message }, { retry: false }), true);
        return;
      }
      await this.record(held, 'complete', () => this.complete(held.claim, outcome), false);
    } finally {
      held.span?.end();
      this.held.delete(held.claim.id);
      this.wake();
    }
  }

  /** Send the result (`call`, in a `settle` span when the handler's is traced) and count it. */
  private async record(
    held: Held,
    outcome: 'complete' | 'fail',
    call: () => Promise<TaskData | ClaimResult>,
    failed: boolean,
  ): Promise<void> {
    let error: unknown = null;
    const recorded = async (): Promise<TaskData | ClaimResult> => {
      const answer = await call();
      // A refusal inside a batch's answer is the settle's failure too.
      if ('ok' in answer && !answer.ok) throw answer.error ?? new RunstateError('not recorded');
      return answer;
    };
    try {
      await (held.span ? held.span.settle(outcome, recorded) : recorded());
    } catch (thrown) {
      error = thrown;
    }
    if (error === null) {
      if (failed) this.summary.failed += 1;
      else this.summary.completed += 1;
      return;
    }
    this.summary.lost += 1;
    this.log(isExpectedRefusal(error) ? 'info' : 'error', `task ${held.claim.taskId}: result not recorded (${String(error)})`);
  }

  private async release(claim: Claim): Promise<void> {
    try {
      await claim.release();
      this.summary.released += 1;
    } catch (error) {
      this.log('info', `task ${claim.taskId}: release refused (${String(error)})`);
    }
  }

  // Completions, buffered: the outcomes of handlers that settle together go in one request.

  private complete(claim: Claim, outcome: unknown): Promise<ClaimResult> {
    return new Promise((settle) => {
      this.pendingCompletes.push({ claim, outcome, settle });
      if (this.pendingCompletes.length === 1) setImmediate(() => void this.flushCompletes());
    });
  }

  private async flushCompletes(): Promise<void> {
    const batch = this.pendingCompletes.splice(0, MAX_CLAIM_BATCH);
    if (this.pendingCompletes.length > 0) setImmediate(() => void this.flushCompletes());
    if (batch.length === 0) return;
    if (this.batchComplete) {
      try {
        const results = await this.tasks.completeMany(batch.map((item) => [item.claim, item.outcome] as const));
        batch.forEach((item, index) => item.settle(results[index] ?? { claimId: item.claim.id, ok: false }));
        return;
      } catch (error) {
        if (!this.endpointMissing(error)) {
          const failure = error instanceof RunstateError ? error : new RunstateError(String(error));
          for (const item of batch) item.settle({ claimId: item.claim.id, ok: false, error: failure });
          return;
        }
        this.batchComplete = false;
      }
    }
    await Promise.all(
      batch.map(async (item) => {
        try {
          item.settle({ claimId: item.claim.id, ok: true, task: await item.claim.complete(item.outcome) });
        } catch (error) {
          const failure = error instanceof RunstateError ? error : new RunstateError(String(error));
          item.settle({ claimId: item.claim.id, ok: false, error: failure });
        }
      }),
    );
  }

  /** Whether a batch endpoint is missing on this server (an older one): then one request per claim. */
  private endpointMissing(error: unknown): boolean {
    return error instanceof RunstateError && (error.status === 404 || error.status === 405);
  }

  // Renewing, batched: every held lease in one request per interval.

  private async renewLoop(signal: AbortSignal): Promise<void> {
    const interval = Math.max(MIN_RENEW_INTERVAL_MS, this.leaseMs * this.renewFraction);
    while (!signal.aborted) {
      try {
        await sleep(interval, signal);
      } catch {
        return;
      }
      await this.renewAll();
    }
  }

  private async renewAll(): Promise<void> {
    const helds = [...this.held.values()].filter((held) => !held.lost && !held.recording && !held.abandoned);
    if (helds.length === 0) return;
    const sent = Date.now();
    const options = this.leaseTtlMs === undefined ? {} : { leaseTtlMs: this.leaseTtlMs };
    let results: ClaimResult[] | null = null;
    if (this.batchRenew) {
      try {
        results = await this.tasks.renewMany(
          helds.map((held) => held.claim),
          options,
        );
      } catch (error) {
        if (this.endpointMissing(error)) {
          this.batchRenew = false;
        } else {
          this.renewFailed(helds, error);
          return;
        }
      }
    }
    if (results === null) {
      results = await Promise.all(
        helds.map(async (held): Promise<ClaimResult> => {
          try {
            return { claimId: held.claim.id, ok: true, claim: await held.claim.renew(options) };
          } catch (error) {
            if (error instanceof RunstateError && !isTransient(error)) return { claimId: held.claim.id, ok: false, error };
            this.renewFailed([held], error);
            return { claimId: held.claim.id, ok: true };
          }
        }),
      );
    }
    helds.forEach((held, index) => {
      const result = results?.[index];
      if (result === undefined) return;
      if (result.ok) {
        if (result.claim !== undefined) held.leaseUntil = sent + this.leaseMs;
        if (held.claim.cancellationRequested) held.context.trip('cancellation_requested');
      } else if (result.error instanceof ScopeInactiveError) {
        this.lose(held, 'scope_refused');
      } else {
        this.lose(held, 'lease_lost');
      }
    });
  }

  private renewFailed(helds: Held[], error: unknown): void {
    const now = Date.now();
    for (const held of helds) {
      if (now >= held.leaseUntil) this.lose(held, 'lease_lost');
    }
    this.log('warn', `renewal failed (${String(error)}); retrying`);
  }
}
