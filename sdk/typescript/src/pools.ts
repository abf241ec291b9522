/**
 * Pools (concurrency limits): `rs.pools` and the leases it hands out.
 *
 *     await rs.pools.put('gpu', { capacity: 4 });
 *     await rs.pools.withLease('gpu', { runId, units: 1, waitMs: 10_000 }, async (lease) => {
 *       // renewed in the background; lease.signal aborts if the lease is lost
 *     });
 */

import { LeaseLostError, ScopeInactiveError, TransportError } from './errors.js';
import { Http, MAX_SERVER_WAIT_MS, compact, segment } from './http.js';

export interface PoolData {
  name: string;
  capacity: number;
  inUse: number;
  waiting: number;
}

export type PoolLeaseState = 'WAITING' | 'HELD' | 'RELEASED' | 'EXPIRED' | 'TIMED_OUT' | 'CANCELLED';

export interface PoolLeaseData {
  leaseId: string;
  pool: string;
  runId: string;
  units: number;
  key: string | null;
  state: PoolLeaseState;
  expiresAt: string;
  grantedAt: string | null;
}

export interface AcquireOptions {
  runId: string;
  /** Default 1; more than the pool's capacity is a `ValidationError`. */
  units?: number;
  /** Default 30 000 (the server's). */
  leaseTtlMs?: number;
  /** How long to wait in the pool's queue (0, the default: answer at once); capped at 30 s. */
  waitMs?: number;
  /** Makes the acquire idempotent (and retried): the same key returns the same lease while it is held. */
  key?: string;
  /** Aborts the acquire. */
  signal?: AbortSignal;
}

/** Why a lease's signal aborted: refused renewal (`lease_lost`, `scope_refused`), or `released`. */
export type LeaseLossReason = 'lease_lost' | 'scope_refused' | 'released';

/**
 * A lease on units of a pool; `data` is the lease as last seen.
 *
 * `signal` aborts when a renewal is refused: the lease was released or expired (`LEASE_LOST`), or
 * its run is no longer active (`SCOPE_CANCELLED`, `SCOPE_COMPLETED`, `DEADLINE_EXCEEDED`); `lost`
 * is then true and `lostReason` says which, as for a claim. It also aborts (not lost) on release.
 */
export class PoolLease {
  readonly id: string;
  readonly pool: string;
  readonly units: number;
  data: PoolLeaseData;
  lost = false;
  lostReason: LeaseLossReason | null = null;
  readonly signal: AbortSignal;
  private readonly controller = new AbortController();
  private timer: ReturnType<typeof setTimeout> | null = null;
  private leaseTtlMs = 30_000;

  constructor(
    private readonly http: Http,
    data: PoolLeaseData,
  ) {
    this.data = data;
    this.id = data.leaseId;
    this.pool = data.pool;
    this.units = data.units;
    this.signal = this.controller.signal;
  }

  private get path(): string {
    return `/pool-leases/${segment(this.id)}`;
  }

  private lose(reason: LeaseLossReason): void {
    this.lost = reason !== 'released';
    this.lostReason ??= reason;
    this.stopRenewing();
    if (!this.controller.signal.aborted) this.controller.abort(new Error(`pool lease ${this.id}: ${reason}`));
  }

  /** Return the lease. */
  async status(): Promise<PoolLeaseData> {
    this.data = await this.http.request<PoolLeaseData>('GET', this.path, { idempotent: true });
    return this.data;
  }

  /** Extend the lease; a refusal marks it lost (and is thrown). */
  async renew(options: { leaseTtlMs?: number } = {}): Promise<PoolLeaseData> {
    try {
      this.data = await this.http.request<PoolLeaseData>('POST', `${this.path}/renew`, {
        idempotent: true,
        body: compact({ leaseTtlMs: options.leaseTtlMs }),
      });
      return this.data;
    } catch (error) {
      if (error instanceof LeaseLostError) this.lose('lease_lost');
      else if (error instanceof ScopeInactiveError) this.lose('scope_refused');
      throw error;
    }
  }

  /** Hand the units back (idempotent; allowed under an inactive run) and stop renewing. */
  async release(): Promise<PoolLeaseData> {
    this.stopRenewing();
    this.data = await this.http.request<PoolLeaseData>('POST', `${this.path}/release`, { idempotent: true });
    if (!this.lost) this.lose('released');
    return this.data;
  }

  /** Renew in the background every third of the TTL until released or lost. */
  startRenewing(leaseTtlMs?: number): void {
    if (this.timer !== null || this.controller.signal.aborted) return;
    this.leaseTtlMs = leaseTtlMs ?? this.leaseTtlMs;
    const period = Math.max(this.leaseTtlMs / 3, 50);
    const tick = async (): Promise<void> => {
      try {
        await this.renew({ leaseTtlMs: this.leaseTtlMs });
      } catch (error) {
        if (this.lost) return;
        if (!(error instanceof TransportError)) console.warn(`pool lease ${this.id}: renewal failed`, error);
      }
      if (this.timer !== null) this.timer = setTimeout(() => void tick(), period);
    };
    this.timer = setTimeout(() => void tick(), period);
    this.timer.unref?.();
  }

  /** Stop the background renewal (release does it too). */
  stopRenewing(): void {
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
  }

  /** Release on `await using` (TypeScript 5.2+ explicit resource management). */
  async [Symbol.asyncDispose](): Promise<void> {
    await this.release();
  }
}

/** `rs.pools`: configure pools and acquire leases on them. */
export class Pools {
  constructor(private readonly http: Http) {}

  /** Create the pool or set its capacity (needs `resource_config`; refused to a key bound to a run). */
  put(name: string, options: { capacity: number }): Promise<PoolData> {
    return this.http.request('PUT', `/pools/${segment(name)}`, { idempotent: true, body: { capacity: options.capacity } });
  }

  /** The same as `put`. */
  ensure(name: string, options: { capacity: number }): Promise<PoolData> {
    return this.put(name, options);
  }

  /** Return the pool and its use (for a key bound to a run, `inUse` and `waiting` of its subtree only). */
  retrieve(name: string): Promise<PoolData> {
    return this.http.request('GET', `/pools/${segment(name)}`, { idempotent: true });
  }

  /** Return a handle on a lease by id (no request; `status()` loads it). */
  lease(leaseId: string): PoolLease {
    return new PoolLease(this.http, {
      leaseId,
      pool: '',
      runId: '',
      units: 0,
      key: null,
      state: 'HELD',
      expiresAt: '',
      grantedAt: null,
    });
  }

  /**
   * Acquire units of the pool, waiting in its queue up to `waitMs` (30 s at most); the lease renews
   * in the background until released or lost.
   *
   * Granted strictly first come, first served. Throws `ConflictError` with code `POOL_EXHAUSTED`
   * (`details`: capacity, inUse, waiting) when not granted in time, the run's error
   * (`ScopeCancelledError`...) when the run is or becomes inactive.
   */
  async acquire(name: string, options: AcquireOptions): Promise<PoolLease> {
    const wait = Math.max(0, Math.min(options.waitMs ?? 0, MAX_SERVER_WAIT_MS));
    const data = await this.http.request<PoolLeaseData>('POST', `/pools/${segment(name)}/leases`, {
      idempotent: options.key !== undefined,
      body: compact({
        runId: options.runId,
        units: options.units,
        leaseTtlMs: options.leaseTtlMs,
        waitMs: wait || undefined,
        key: options.key,
      }),
      waitMs: wait,
      signal: options.signal,
    });
    const lease = new PoolLease(this.http, data);
    lease.startRenewing(options.leaseTtlMs);
    return lease;
  }

  /** Acquire, run `body(lease)`, and release whatever happens; answer what `body` answers. */
  async withLease<T>(name: string, options: AcquireOptions, body: (lease: PoolLease) => Promise<T>): Promise<T> {
    const lease = await this.acquire(name, options);
    try {
      return await body(lease);
    } finally {
      await lease.release();
    }
  }
}
