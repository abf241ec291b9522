/**
 * What the task loop (`scope.consume`) and the message loop (`scope.consumeMessages`) share.
 *
 * Both fetch work sized to their free slots (claims or deliveries), long-poll for it, back off
 * on transient failures, stop when the run refuses work, on `SIGTERM`, `stop()` or the `signal`
 * option, hand back what arrives after a stop, give running handlers `drainTimeoutMs` and then
 * hand their work back. `FetchLoop` is that skeleton; each loop says how to fetch, start, lose
 * and hand back one item, and owns everything about running it. `HandlerContext` is the part of
 * a handler's context that says whether (and why) it should stop.
 */

import {
  LeaseLostError,
  NotFoundError,
  RateLimitedError,
  ScopeInactiveError,
  ServerError,
  ServiceUnavailableError,
  TransportError,
} from './errors.js';
import { Http, segment, sleep } from './http.js';
import type { Mailbox } from './types.js';

/** Why a handler's signal aborted. */
export type StopReason = 'cancellation_requested' | 'lease_lost' | 'scope_refused' | 'stopping';

/** Where a loop reports what it does. */
export type LoopLog = (level: 'info' | 'warn' | 'error', message: string) => void;

// How long to pause after a transient fetch failure: doubles per failure up to the cap.
const FETCH_BACKOFF_MS = 500;
const FETCH_BACKOFF_MAX_MS = 15_000;
// With a short (or no) long-poll, pause this long after an empty answer instead of spinning.
const IDLE_PAUSE_MS = 500;
/** A renewal (or extend) must leave room to reach the server before the lease runs out. */
export const MIN_RENEW_INTERVAL_MS = 50;

/** Whether a failure is ridden out with backoff rather than ending the loop. */
export function isTransient(error: unknown): boolean {
  return (
    error instanceof TransportError ||
    error instanceof ServiceUnavailableError ||
    error instanceof RateLimitedError ||
    error instanceof ServerError
  );
}

/** Whether a refused record (or answer) is the expected kind: the lease is gone or the run refuses work. */
export function isExpectedRefusal(error: unknown): boolean {
  return error instanceof LeaseLostError || error instanceof ScopeInactiveError || error instanceof NotFoundError;
}

function defaultLog(level: 'info' | 'warn' | 'error', message: string): void {
  if (level !== 'info') console.error(`runstate worker: ${message}`);
}

/** What a handler's context says about stopping: `signal`, `isCancellationRequested()`, `stopReason`. */
export class HandlerContext {
  /** Aborts when the handler should stop: see `stopReason`. */
  readonly signal: AbortSignal;
  /** Why `signal` aborted (`null` while it has not). */
  stopReason: StopReason | null = null;
  /** @internal The work is gone (lease lost, run refused, answer refused): the handler's result cannot count. */
  protected lostWork = false;
  private readonly controller = new AbortController();
  private readonly what: string;

  /** @internal */
  constructor(what: string) {
    this.what = what;
    this.signal = this.controller.signal;
  }

  // The checks are bound to the context (arrow properties, not prototype methods), so a
  // handler may destructure them: `async ({ input, signal, isCancellationRequested }) => ...`.

  /** Return whether the handler should stop (its signal aborted). */
  readonly isCancellationRequested = (): boolean => this.signal.aborted;

  /** Throw the signal's reason (an `AbortError`) if the handler should stop. */
  readonly throwIfCancellationRequested = (): void => {
    this.signal.throwIfAborted();
  };

  /** @internal Abort the signal, remembering the first reason; `lost` marks the work lost too. */
  trip(reason: StopReason, lost = false): void {
    this.lostWork ||= lost;
    if (this.stopReason !== null) return;
    this.stopReason = reason;
    this.controller.abort(new DOMException(`runstate: ${reason.replace('_', ' ')} (${this.what})`, 'AbortError'));
  }
}

/** A handler's result: its value, or what it threw. */
export type Settled = { ok: true; value: unknown } | { ok: false; error: unknown };

/** Run `handler` (sync or async) and return how it settled; it never rejects. */
export async function settle(handler: () => unknown): Promise<Settled> {
  try {
    return { ok: true, value: await handler() };
  } catch (error) {
    return { ok: false, error };
  }
}

/** One item being worked on: its context, and how far it got. */
export interface HeldItem {
  readonly context: HandlerContext;
  /** The work is gone: nothing may be recorded. */
  lost: boolean;
  /** The loop gave up on the handler while stopping: its work is handed back. */
  abandoned: boolean;
  /** The handler settled: its result is being recorded (renewals leave it alone). */
  recording: boolean;
  /** Stop waiting for the handler (resolves `dropped`). */
  readonly drop: () => void;
  /** Resolves once the handler stopped mattering (the loop stopped waiting for it). */
  readonly dropped: Promise<void>;
  /** Settles when the item is done with (recorded, lost or handed back). */
  done: Promise<void>;
}

/** Return the state of an item that has just started (everything of `HeldItem` but its context). */
export function freshHeld(): Omit<HeldItem, 'context'> {
  let drop: () => void = () => undefined;
  const dropped = new Promise<void>((resolve) => {
    drop = resolve;
  });
  return { lost: false, abandoned: false, recording: false, drop, dropped, done: Promise.resolve() };
}

/** The counters every loop's summary has. */
export interface LoopSummary {
  lost: number;
  released: number;
  stopReason: string;
}

/** The options every loop takes. */
export interface LoopOptions {
  /** Handlers running at once (default 1). */
  concurrency?: number;
  /** When stopping, how long running handlers get to finish before their work is handed back (default 30 000). */
  drainTimeoutMs?: number;
  /** Stop on `SIGTERM` (default true). */
  handleSignals?: boolean;
  /** Stop when this signal aborts. */
  signal?: AbortSignal;
  /** Where the loop reports what it does (default: warnings and errors to `console.error`). */
  log?: LoopLog;
}

// SIGTERM stops every running loop of the process; one listener, removed with the last loop.
const sigtermLoops = new Set<{ stop(): void }>();
function onSigterm(): void {
  for (const loop of [...sigtermLoops]) loop.stop();
}

/**
 * A loop on one run and mailbox: `await loop.run()`; `loop.stop()` ends it.
 *
 * A subclass fills `summary`, and says how to fetch up to `max` items (`fetch`), start one (`start`, which adds it to `held`), hand back one it will not run
 * (`handBack`), hand back a held one whose handler is given up on (`abandon`) and name one
 * for the log (`label`); `background` runs beside the fetch loop until it ends.
 */
export abstract class FetchLoop<Item, H extends HeldItem, S extends LoopSummary> {
  readonly runId: string;
  readonly mailbox: string;
  abstract readonly summary: S;
  protected readonly held = new Map<string, H>();
  protected readonly stopController = new AbortController();
  protected readonly concurrency: number;
  protected readonly log: LoopLog;
  private readonly drainTimeoutMs: number;
  private readonly handleSignals: boolean;
  private readonly externalSignal: AbortSignal | undefined;
  private readonly fetchWaitMs: number;
  /** The lease of each item (a claim's lease, a delivery's visibility), known once `run()` starts. */
  protected leaseMs = 30_000;
  private readonly leaseOption: number | undefined;
  private changed: (() => void) | null = null;
  private started = false;

  /** `leaseMs`: the lease option (`undefined`: the mailbox's `leaseTtlMs`); `fetchWaitMs`: the fetch's long-poll. */
  protected constructor(
    protected readonly http: Http,
    runId: string,
    mailbox: string,
    options: LoopOptions,
    { leaseMs, fetchWaitMs }: { leaseMs: number | undefined; fetchWaitMs: number },
  ) {
    const concurrency = options.concurrency ?? 1;
    if (!Number.isInteger(concurrency) || concurrency < 1) throw new RangeError('concurrency must be an integer >= 1');
    this.runId = runId;
    this.mailbox = mailbox;
    this.concurrency = concurrency;
    this.drainTimeoutMs = options.drainTimeoutMs ?? 30_000;
    this.handleSignals = options.handleSignals ?? true;
    this.log = options.log ?? defaultLog;
    this.externalSignal = options.signal;
    this.fetchWaitMs = fetchWaitMs;
    this.leaseOption = leaseMs;
  }

  protected abstract fetch(max: number, signal: AbortSignal): Promise<Item[]>;
  protected abstract start(item: Item): void;
  protected abstract handBack(item: Item): Promise<void>;
  protected abstract abandon(held: H): Promise<void>;
  protected abstract label(held: H): string;

  /** Work done beside the fetch loop until `signal` aborts (none by default). */
  protected background(_signal: AbortSignal): Promise<void> {
    return Promise.resolve();
  }

  /** What to wait for, once the background started, before the first fetch (nothing by default). */
  protected ready(): Promise<void> {
    return Promise.resolve();
  }

  /** Stop fetching; running handlers get `drainTimeoutMs` to finish and record. */
  stop(): void {
    if (this.stopController.signal.aborted) return;
    this.summary.stopReason ||= 'stopped';
    this.stopController.abort(new DOMException('runstate: the worker is stopping', 'AbortError'));
    this.wake();
  }

  protected get stopping(): boolean {
    return this.stopController.signal.aborted;
  }

  /** Tell the fetch loop that a slot may have freed. */
  protected wake(): void {
    const changed = this.changed;
    this.changed = null;
    changed?.();
  }

  /** Work until the run refuses work, `stop()`, `SIGTERM` or the `signal` option; resolve with the summary. */
  async run(): Promise<S> {
    if (this.started) throw new Error(`A ${this.constructor.name} runs once; make another.`);
    this.started = true;
    const onExternalAbort = (): void => this.stop();
    if (this.externalSignal?.aborted) this.stop();
    this.externalSignal?.addEventListener('abort', onExternalAbort, { once: true });
    if (this.handleSignals) {
      if (sigtermLoops.size === 0) process.on('SIGTERM', onSigterm);
      sigtermLoops.add(this);
    }
    const backgroundStop = new AbortController();
    let background: Promise<void> | null = null;
    try {
      if (this.leaseOption === undefined) {
        const mailbox = await this.http.request<Mailbox>('GET', `/mailboxes/${segment(this.mailbox)}`, { idempotent: true });
        this.leaseMs = mailbox.leaseTtlMs;
      } else {
        this.leaseMs = this.leaseOption;
      }
      background = this.background(backgroundStop.signal);
      try {
        await this.ready();
        await this.fetchLoop();
      } catch (error) {
        // An error that ends the loop: hand everything back now, then throw it.
        await this.shutdown(0);
        throw error;
      }
      await this.shutdown(this.drainTimeoutMs);
      return { ...this.summary };
    } finally {
      backgroundStop.abort();
      await background;
      this.externalSignal?.removeEventListener('abort', onExternalAbort);
      if (sigtermLoops.delete(this) && sigtermLoops.size === 0) process.off('SIGTERM', onSigterm);
    }
  }

  private async fetchLoop(): Promise<void> {
    let failures = 0;
    while (!this.stopping) {
      const free = this.concurrency - this.held.size;
      if (free <= 0) {
        await new Promise<void>((resolve) => {
          this.changed = resolve;
        });
        continue;
      }
      let items: Item[];
      try {
        items = await this.fetch(free, this.stopController.signal);
      } catch (error) {
        if (this.stopping) {
          // Stopping mid-wait. The server may still hand out an item the answer to this
          // abandoned request carried: its lease (or visibility) runs out and it is handed out again.
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
          const pause = Math.min(FETCH_BACKOFF_MAX_MS, FETCH_BACKOFF_MS * 2 ** (failures - 1));
          this.log('warn', `fetching from ${this.mailbox} failed (${String(error)}); retrying in ${pause} ms`);
          await sleep(pause, this.stopController.signal).catch(() => undefined);
          continue;
        }
        throw error;
      }
      failures = 0;
      if (this.stopping) {
        await Promise.all(items.map((item) => this.handBack(item)));
        return;
      }
      for (const item of items) this.start(item);
      if (items.length === 0 && this.fetchWaitMs < IDLE_PAUSE_MS) {
        await sleep(IDLE_PAUSE_MS, this.stopController.signal).catch(() => undefined);
      }
    }
  }

  /** Mark the item lost: abort its signal and stop waiting for its handler (its result can no longer count). */
  protected lose(held: H, reason: StopReason): void {
    if (held.lost || held.recording) return;
    held.lost = true;
    this.summary.lost += 1;
    this.log('info', `${this.label(held)} lost (${reason})`);
    held.context.trip(reason, true);
    held.drop();
  }

  /** Let running handlers finish for `drainMs`, then give up on them and hand their work back. */
  private async shutdown(drainMs: number): Promise<void> {
    const running = [...this.held.values()].map((held) => held.done);
    if (running.length > 0 && drainMs > 0) {
      this.log('info', `stopping: waiting up to ${drainMs} ms for ${running.length} handler(s)`);
      let timer: NodeJS.Timeout | undefined;
      await Promise.race([Promise.all(running), new Promise<void>((resolve) => (timer = setTimeout(resolve, drainMs)))]);
      clearTimeout(timer);
    }
    const handBacks: Promise<void>[] = [];
    for (const held of [...this.held.values()]) {
      if (held.recording || held.lost || held.abandoned) continue;
      held.abandoned = true;
      held.context.trip('stopping');
      held.drop();
      handBacks.push(this.abandon(held));
    }
    await Promise.all(handBacks);
    await Promise.all([...this.held.values()].map((held) => held.done));
  }
}
