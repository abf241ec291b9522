/**
 * The worker loop behind `scope.consume`: claim, renew leases in the background (batched),
 * run handlers, record their results (completions batched), stop.
 *
 * A JavaScript promise cannot be cancelled: a handler is told to stop through
 * `context.signal`, an `AbortSignal` that aborts when cancellation is requested, when the lease
 * is lost, when the run refuses work, or when the worker gives up on it while stopping. Pass it
 * to `fetch` and other I/O so that work in flight rejects at once.
 */

import { hostname } from 'node:os';

import {
  LeaseLostError,
  NotFoundError,
  RateLimitedError,
  RunstateError,
  ScopeInactiveError,
  ServerError,
  ServiceUnavailableError,
  TransportError,
} from './errors.js';
import { Http, segment, sleep } from './http.js';
import type { Mailbox, TaskData } from './types.js';
import { Claim, MAX_CLAIM_BATCH, Tasks, type ClaimResult } from './work.js';

/** Why a handler's signal aborted. */
export type StopReason = 'cancellation_requested' | 'lease_lost' | 'scope_refused' | 'stopping';

// How long to pause after a transient claim failure: doubles per failure up to the cap.
const CLAIM_BACKOFF_MS = 500;
const CLAIM_BACKOFF_MAX_MS = 15_000;
// A renewal must leave room to reach the server before the lease runs out.
const MIN_RENEW_INTERVAL_MS = 50;
// With a short (or no) claim long-poll, pause this long after an empty answer instead of spinning.
const IDLE_PAUSE_MS = 500;

function isTransient(error: unknown): boolean {
  return (
    error instanceof TransportError ||
    error instanceof ServiceUnavailableError ||
    error instanceof RateLimitedError ||
    error instanceof ServerError
  );
}

/** What a handler gets: the claimed task, and whether (and why) it should stop. */
export class TaskContext<I = unknown> {
  /** The task's input (parsed by the task's `schema`, when it has one). */
  readonly input: I;
  readonly task: TaskData;
  readonly taskId: string;
  readonly claimId: string;
  /** 1 for the first claim of the task, 2 after a retry or a takeover... */
  readonly attempt: number;
  readonly key: string | null;
  /** Aborts when cancellation is requested, the lease is lost, the run refuses work, or the worker gives up. */
  readonly signal: AbortSignal;
  /** Why `signal` aborted (`null` while it has not). */
  stopReason: StopReason | null = null;
  private readonly controller: AbortController;

  /** @internal */
  constructor(claim: Claim, input: I, controller: AbortController) {
    this.task = claim.task;
    this.taskId = claim.taskId;
    this.claimId = claim.id;
    this.attempt = claim.attempt;
    this.key = claim.task.key;
    this.input = input;
    this.controller = controller;
    this.signal = controller.signal;
  }

  // The two checks are bound to this context (arrow properties, not prototype methods), so a
  // handler may destructure them: `async ({ input, signal, isCancellationRequested }) => ...`.

  /** Return whether the handler should stop (cancellation requested, lease lost, run refused or stopping). */
  readonly isCancellationRequested = (): boolean => this.signal.aborted;

  /** Throw the signal's reason (an `AbortError`) if the handler should stop. */
  readonly throwIfCancellationRequested = (): void => {
    this.signal.throwIfAborted();
  };

  /** @internal Abort the signal, remembering the first reason. */
  trip(reason: StopReason): void {
    if (this.stopReason !== null) return;
    this.stopReason = reason;
    this.controller.abort(new DOMException(`runstate: ${reason.replace('_', ' ')} (task ${this.taskId})`, 'AbortError'));
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
export interface ConsumeSummary {
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

export interface ConsumeOptions {
  /** Handlers running at once (default 1). */
  concurrency?: number;
  /** The lease of each claim (default: the mailbox's `leaseTtlMs`). */
  leaseTtlMs?: number;
  workerId?: string;
  /** How long one claim request may wait for work (30 000 at most, the default). */
  claimWaitMs?: number;
  /** Renew leases every this fraction of their TTL (default 1/3). */
  renewFraction?: number;
  /** When stopping, how long running handlers get to finish before their tasks are released (default 30 000). */
  drainTimeoutMs?: number;
  /** Stop on `SIGTERM` (default true). */
  handleSignals?: boolean;
  /** Stop when this signal aborts. */
  signal?: AbortSignal;
  /** Where the loop reports what it does (default: warnings and errors to `console.error`). */
  log?: (level: 'info' | 'warn' | 'error', message: string) => void;
}

interface Held {
  claim: Claim;
  context: TaskContext<unknown>;
  leaseUntil: number;
  /** The claim is gone: nothing may be recorded. */
  lost: boolean;
  /** The worker gave up on the handler while stopping: its task is released. */
  abandoned: boolean;
  /** The handler settled: its result is being recorded (renewals leave it alone). */
  recording: boolean;
  drop: () => void;
  done: Promise<void>;
}

// SIGTERM stops every running worker of the process; one listener, removed with the last worker.
const sigtermWorkers = new Set<Worker>();
function onSigterm(): void {
  for (const worker of [...sigtermWorkers]) worker.stop();
}

function defaultLog(level: 'info' | 'warn' | 'error', message: string): void {
  if (level !== 'info') console.error(`runstate worker: ${message}`);
}

/** Return the failure record of a handler's error. */
export function describeError(error: unknown): Record<string, unknown> {
  if (error instanceof Error) {
    return { type: error.name, message: error.message, stack: (error.stack ?? '').slice(-4000) };
  }
  return { type: typeof error, message: String(error) };
}

/** A worker loop on one run and mailbox: `await worker.run()`; `worker.stop()` ends it. */
export class Worker {
  readonly runId: string;
  readonly mailbox: string;
  readonly workerId: string;
  readonly summary: ConsumeSummary = { completed: 0, failed: 0, lost: 0, released: 0, stopReason: '' };
  private readonly tasks: Tasks;
  private readonly handler: Handler<unknown> | TaskDefinition<unknown>;
  private readonly concurrency: number;
  private readonly leaseTtlMs: number | undefined;
  private readonly claimWaitMs: number;
  private readonly renewFraction: number;
  private readonly drainTimeoutMs: number;
  private readonly handleSignals: boolean;
  private readonly log: (level: 'info' | 'warn' | 'error', message: string) => void;
  private readonly held = new Map<string, Held>();
  private readonly stopController = new AbortController();
  private readonly externalSignal: AbortSignal | undefined;
  private ttlMs = 30_000;
  private changed: (() => void) | null = null;
  private batchRenew = true;
  private batchComplete = true;
  private pendingCompletes: { claim: Claim; outcome: unknown; settle: (result: ClaimResult) => void }[] = [];
  private started = false;

  constructor(
    private readonly http: Http,
    runId: string,
    mailbox: string,
    handler: Handler<any> | TaskDefinition<any>,
    options: ConsumeOptions = {},
  ) {
    const concurrency = options.concurrency ?? 1;
    if (!Number.isInteger(concurrency) || concurrency < 1) throw new RangeError('concurrency must be an integer >= 1');
    const renewFraction = options.renewFraction ?? 1 / 3;
    if (!(renewFraction > 0 && renewFraction < 1)) throw new RangeError('renewFraction must be between 0 and 1');
    this.runId = runId;
    this.mailbox = mailbox;
    this.tasks = new Tasks(http, runId);
    this.handler = handler;
    this.concurrency = concurrency;
    this.leaseTtlMs = options.leaseTtlMs;
    this.workerId = options.workerId ?? `${hostname()}:${process.pid}:${Math.random().toString(16).slice(2, 10)}`;
    this.claimWaitMs = Math.max(0, Math.min(options.claimWaitMs ?? 30_000, 30_000));
    this.renewFraction = renewFraction;
    this.drainTimeoutMs = options.drainTimeoutMs ?? 30_000;
    this.handleSignals = options.handleSignals ?? true;
    this.log = options.log ?? defaultLog;
    this.externalSignal = options.signal;
  }

  /** Stop claiming; running handlers get `drainTimeoutMs` to finish and record. */
  stop(): void {
    if (this.stopController.signal.aborted) return;
    this.summary.stopReason ||= 'stopped';
    this.stopController.abort(new DOMException('runstate: the worker is stopping', 'AbortError'));
    this.wake();
  }

  private get stopping(): boolean {
    return this.stopController.signal.aborted;
  }

  private wake(): void {
    const changed = this.changed;
    this.changed = null;
    changed?.();
  }

  /** Work until the run refuses work, `stop()`, `SIGTERM` or the `signal` option; resolve with the summary. */
  async run(): Promise<ConsumeSummary> {
    if (this.started) throw new Error('A Worker runs once; make another with scope.worker(...).');
    this.started = true;
    const onExternalAbort = (): void => this.stop();
    if (this.externalSignal?.aborted) this.stop();
    this.externalSignal?.addEventListener('abort', onExternalAbort, { once: true });
    if (this.handleSignals) {
      if (sigtermWorkers.size === 0) process.on('SIGTERM', onSigterm);
      sigtermWorkers.add(this);
    }
    const renewing = new AbortController();
    let renewer: Promise<void> | null = null;
    try {
      if (this.leaseTtlMs === undefined) {
        const mailbox = await this.http.request<Mailbox>('GET', `/mailboxes/${segment(this.mailbox)}`, { idempotent: true });
        this.ttlMs = mailbox.leaseTtlMs;
      } else {
        this.ttlMs = this.leaseTtlMs;
      }
      renewer = this.renewLoop(renewing.signal);
      try {
        await this.claimLoop();
      } catch (error) {
        // An error that ends the loop: hand everything back now, then throw it.
        await this.shutdown(0);
        throw error;
      }
      await this.shutdown(this.drainTimeoutMs);
      return { ...this.summary };
    } finally {
      renewing.abort();
      await renewer;
      this.externalSignal?.removeEventListener('abort', onExternalAbort);
      if (sigtermWorkers.delete(this) && sigtermWorkers.size === 0) process.off('SIGTERM', onSigterm);
    }
  }

  // Claiming ---------------------------------------------------------------------------------

  private async claimLoop(): Promise<void> {
    let failures = 0;
    while (!this.stopping) {
      const free = this.concurrency - this.held.size;
      if (free <= 0) {
        await new Promise<void>((resolve) => {
          this.changed = resolve;
        });
        continue;
      }
      let claims: Claim[];
      try {
        claims = await this.tasks.claim(this.mailbox, {
          max: free,
          waitMs: this.claimWaitMs,
          workerId: this.workerId,
          signal: this.stopController.signal,
          ...(this.leaseTtlMs === undefined ? {} : { leaseTtlMs: this.leaseTtlMs }),
        });
      } catch (error) {
        if (this.stopping) {
          // Stopping mid-wait. The server may still hand out a task the answer to this
          // abandoned request carried: its lease expires and it is taken over.
          return;
        }
        if (error instanceof ScopeInactiveError) {
          this.log('info', `run ${this.runId} refuses work (${error.code}): stopping`);
          this.summary.stopReason = error.code;
          for (const held of [...this.held.values()]) this.lose(held, 'scope_refused');
          return;
        }
        if (isTransient(error)) {
          failures += 1;
          const pause = Math.min(CLAIM_BACKOFF_MAX_MS, CLAIM_BACKOFF_MS * 2 ** (failures - 1));
          this.log('warn', `claim on ${this.mailbox} failed (${String(error)}); retrying in ${pause} ms`);
          await sleep(pause, this.stopController.signal).catch(() => undefined);
          continue;
        }
        throw error;
      }
      failures = 0;
      if (this.stopping) {
        await Promise.all(claims.map((claim) => this.release(claim)));
        return;
      }
      for (const claim of claims) this.start(claim);
      if (claims.length === 0 && this.claimWaitMs < IDLE_PAUSE_MS) {
        await sleep(IDLE_PAUSE_MS, this.stopController.signal).catch(() => undefined);
      }
    }
  }

  // Running one task -------------------------------------------------------------------------

  private start(claim: Claim): void {
    const controller = new AbortController();
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
    const context = new TaskContext<unknown>(claim, input, controller);
    let drop: () => void = () => undefined;
    const dropped = new Promise<void>((resolve) => {
      drop = resolve;
    });
    const held: Held = {
      claim,
      context,
      leaseUntil: Date.now() + this.ttlMs,
      lost: false,
      abandoned: false,
      recording: false,
      drop,
      done: Promise.resolve(),
    };
    this.held.set(claim.id, held);
    if (claim.cancellationRequested) context.trip('cancellation_requested');
    held.done = this.supervise(held, definition, invalid, dropped);
  }

  private async supervise(
    held: Held,
    definition: TaskDefinition<unknown> | null,
    invalid: unknown,
    dropped: Promise<void>,
  ): Promise<void> {
    try {
      if (invalid !== undefined) {
        held.recording = true;
        const error = { ...describeError(invalid), type: 'InputValidationError' };
        await this.record(held, held.claim.fail(error, { retry: false }), true);
        return;
      }
      const handler = this.handler;
      const running: Promise<{ ok: true; value: unknown } | { ok: false; error: unknown }> = (async () => {
        try {
          const value = definition ? await definition.run(held.context.input, held.context) : await (handler as Handler)(held.context);
          return { ok: true as const, value };
        } catch (error) {
          return { ok: false as const, error };
        }
      })();
      const settled = await Promise.race([running, dropped.then(() => null)]);
      if (settled === null || held.lost || held.abandoned) {
        // The claim is gone (counted by lose()) or released by shutdown(): the result cannot count.
        return;
      }
      held.recording = true;
      if (!settled.ok) {
        this.log('warn', `task ${held.claim.taskId} attempt ${held.claim.attempt} failed: ${String(settled.error)}`);
        await this.record(held, held.claim.fail(describeError(settled.error), { retry: true }), true);
        return;
      }
      const outcome = settled.value === undefined ? null : settled.value;
      try {
        JSON.stringify(outcome);
      } catch (error) {
        const message = `The handler's return value is not JSON: ${String(error)}`;
        await this.record(held, held.claim.fail({ type: 'TypeError', message }, { retry: false }), true);
        return;
      }
      await this.record(held, this.complete(held.claim, outcome), false);
    } finally {
      this.held.delete(held.claim.id);
      this.wake();
    }
  }

  /** Mark the claim lost: abort the signal and stop waiting for the handler (its result can no longer count). */
  private lose(held: Held, reason: StopReason): void {
    if (held.lost || held.recording) return;
    held.lost = true;
    this.summary.lost += 1;
    this.log('info', `task ${held.claim.taskId}: claim lost (${reason})`);
    held.context.trip(reason);
    held.drop();
  }

  private async record(held: Held, call: Promise<TaskData | ClaimResult>, failed: boolean): Promise<void> {
    let error: unknown = null;
    try {
      const answer = await call;
      if ('ok' in answer && !answer.ok) error = answer.error;
    } catch (thrown) {
      error = thrown;
    }
    if (error === null) {
      if (failed) this.summary.failed += 1;
      else this.summary.completed += 1;
      return;
    }
    this.summary.lost += 1;
    const expected = error instanceof LeaseLostError || error instanceof ScopeInactiveError || error instanceof NotFoundError;
    this.log(expected ? 'info' : 'error', `task ${held.claim.taskId}: result not recorded (${String(error)})`);
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
    const interval = Math.max(MIN_RENEW_INTERVAL_MS, this.ttlMs * this.renewFraction);
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
        if (result.claim !== undefined) held.leaseUntil = sent + this.ttlMs;
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

  // Stopping ---------------------------------------------------------------------------------

  /** Let running handlers finish for `drainMs`, then give up on them and release their tasks. */
  private async shutdown(drainMs: number): Promise<void> {
    const running = [...this.held.values()].map((held) => held.done);
    if (running.length > 0 && drainMs > 0) {
      this.log('info', `stopping: waiting up to ${drainMs} ms for ${running.length} handler(s)`);
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([Promise.all(running), new Promise<void>((resolve) => (timer = setTimeout(resolve, drainMs)))]);
      clearTimeout(timer);
    }
    const releases: Promise<void>[] = [];
    for (const held of [...this.held.values()]) {
      if (held.recording || held.lost || held.abandoned) continue;
      held.abandoned = true;
      held.context.trip('stopping');
      held.drop();
      releases.push(this.release(held.claim));
    }
    await Promise.all(releases);
    await Promise.all([...this.held.values()].map((held) => held.done));
  }
}
