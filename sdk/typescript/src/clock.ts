/** Barriers and durable timers: `run.barriers` / `run.timers` and their handles. */

import { ConflictError } from './errors.js';
import { Http, compact, parseTime, segment, wireTime } from './http.js';
import type { BarrierData, TimerData } from './types.js';
import type { WaitTimeout } from './work.js';

function waitLimit(options: WaitTimeout): number | null {
  return options.timeoutMs === undefined ? 60_000 : options.timeoutMs;
}

/** A handle on a barrier; `data` is the barrier as last seen (`null` until loaded). */
export class Barrier {
  readonly id: string;
  data: BarrierData | null;

  constructor(
    private readonly http: Http,
    id: string,
    data: BarrierData | null = null,
  ) {
    this.id = id;
    this.data = data;
  }

  private get path(): string {
    return `/barriers/${segment(this.id)}`;
  }

  /** Return the barrier in its current epoch. */
  async status(): Promise<BarrierData> {
    this.data = await this.http.request<BarrierData>('GET', this.path, { idempotent: true });
    return this.data;
  }

  /** Record `key`'s arrival in the current epoch (the same key again changes nothing). */
  async arrive(options: { key: string }): Promise<BarrierData> {
    this.data = await this.http.request<BarrierData>('POST', `${this.path}/arrive`, {
      idempotent: true,
      body: { key: options.key },
    });
    return this.data;
  }

  /**
   * Wait until the barrier is released and return it; `TimeoutError` after `timeoutMs` (default 60 s).
   *
   * Throws `ConflictError` with code `BARRIER_CANCELLED` if the barrier is cancelled (for example
   * with its run). A barrier already moved on to a later epoch counts as released.
   */
  async wait(options: WaitTimeout = {}): Promise<BarrierData> {
    let firstEpoch: number | null = null;
    this.data = await this.http.wait<BarrierData>(`${this.path}/wait`, {
      done: (barrier) => {
        if (barrier.state === 'CANCELLED') {
          // The server answers 409 itself; a defensive check.
          throw new ConflictError('The barrier is cancelled.', { code: 'BARRIER_CANCELLED', status: 409 });
        }
        firstEpoch ??= barrier.epoch;
        return barrier.state === 'RELEASED' || barrier.epoch > firstEpoch;
      },
      timeoutMs: waitLimit(options),
      what: `Barrier ${this.id}`,
    });
    return this.data;
  }

  /** Move a released barrier to the next epoch with no arrivals (`BARRIER_NOT_RELEASED` otherwise); never retried. */
  async nextEpoch(): Promise<BarrierData> {
    this.data = await this.http.request<BarrierData>('POST', `${this.path}/nextEpoch`, { idempotent: false });
    return this.data;
  }
}

/** `run.barriers`: create barriers under the run and re-attach to them. */
export class Barriers {
  constructor(
    private readonly http: Http,
    private readonly runId: string | null,
  ) {}

  /** Return a handle on the barrier (no request). */
  get(barrierId: string): Barrier {
    return new Barrier(this.http, barrierId);
  }

  /** Create a barrier that releases once `target` distinct keys arrived (needs `resource_config`). */
  async create(options: { target: number; name?: string }): Promise<Barrier> {
    if (this.runId === null) throw new Error('barriers.create needs a run: use rs.scope(runId).barriers.create(...).');
    const barrier = await this.http.request<BarrierData>('POST', '/barriers', {
      idempotent: false,
      body: compact({ runId: this.runId, target: options.target, name: options.name }),
    });
    return new Barrier(this.http, barrier.id, barrier);
  }
}

/** What `timer.wait()` answers: the timer, with `firedAt` as a `Date`. */
export interface FiredTimer extends Omit<TimerData, 'firedAt'> {
  firedAt: Date;
}

/**
 * A handle on a durable timer.
 *
 * `fireAt` (a `Date`) is known from the create answer; a handle from `get(id)` has it once
 * `status()` (or `wait()`) has loaded the timer.
 */
export class Timer {
  readonly id: string;
  data: TimerData | null = null;
  fireAt: Date | null = null;

  constructor(
    private readonly http: Http,
    id: string,
    data: TimerData | null = null,
  ) {
    this.id = id;
    if (data !== null) this.update(data);
  }

  private get path(): string {
    return `/timers/${segment(this.id)}`;
  }

  private update(data: TimerData): TimerData {
    this.data = data;
    this.fireAt = parseTime(data.fireAt);
    return data;
  }

  /** Return the timer (and load `fireAt`). */
  async status(): Promise<TimerData> {
    return this.update(await this.http.request<TimerData>('GET', this.path, { idempotent: true }));
  }

  /**
   * Wait until the timer fires, acknowledge it, and return it with `firedAt` as a `Date`.
   *
   * Idempotent (a second wait answers the same). `TimeoutError` after `timeoutMs` (default 60 s);
   * `ConflictError` (`INVALID_STATE`) if the timer was cancelled.
   */
  async wait(options: WaitTimeout = {}): Promise<FiredTimer> {
    const timer = await this.http.wait<TimerData>(`${this.path}/wait`, {
      method: 'POST',
      done: (answer) => answer.state === 'ACKNOWLEDGED',
      timeoutMs: waitLimit(options),
      what: `Timer ${this.id}`,
    });
    this.update(timer);
    return { ...timer, firedAt: parseTime(timer.firedAt) ?? new Date(Number.NaN) };
  }

  /** Disarm the timer (`ConflictError` `TIMER_FIRED` once it fired; a cancelled one is unchanged). */
  async cancel(): Promise<TimerData> {
    return this.update(await this.http.request<TimerData>('POST', `${this.path}/cancel`, { idempotent: true }));
  }
}

/** The created timer: `fireAt` is known. */
export interface ArmedTimer extends Timer {
  fireAt: Date;
}

/** `run.timers`: arm timers under the run and re-attach to them. */
export class Timers {
  constructor(
    private readonly http: Http,
    private readonly runId: string | null,
  ) {}

  /** Return a handle on the timer (no request; `fireAt` is set by `status()`). */
  get(timerId: string): Timer {
    return new Timer(this.http, timerId);
  }

  /** Arm a timer at `at` or after `afterSeconds` (exactly one); a past `at` fires at once. */
  async create(options: { at: Date | string } | { afterSeconds: number }): Promise<ArmedTimer> {
    if (this.runId === null) throw new Error('timers.create needs a run: use rs.scope(runId).timers.create(...).');
    const at = 'at' in options ? options.at : undefined;
    const afterSeconds = 'afterSeconds' in options ? options.afterSeconds : undefined;
    if ((at === undefined) === (afterSeconds === undefined)) throw new Error('Pass exactly one of at and afterSeconds.');
    const timer = await this.http.request<TimerData>('POST', '/timers', {
      idempotent: false,
      body: compact({ runId: this.runId, at: wireTime(at), afterSeconds }),
    });
    return new Timer(this.http, timer.id, timer) as ArmedTimer;
  }
}
