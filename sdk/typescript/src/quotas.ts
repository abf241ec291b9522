/** Quotas (rate limits as token buckets): `rs.quotas.put` / `get` / `take`. */

import { ConflictError } from './errors.js';
import { Http, MAX_SERVER_WAIT_MS, segment } from './http.js';

/** A quota: `available` is the whole tokens its bucket holds now. */
export interface QuotaData {
  name: string;
  limit: number;
  periodMs: number;
  available: number;
}

/** A granted take: the whole tokens left. */
export interface QuotaTake {
  granted: true;
  remaining: number;
}

export interface QuotaTakeOptions {
  /** The run the tokens are for (default `RUNSTATE_SCOPE_ID`). */
  runId?: string;
  amount?: number;
  /** How long to wait for the tokens (default 0); waits over the server's 30 s cap are split. */
  waitMs?: number;
}

/** `rs.quotas`: configure a project's quotas and take tokens from them. */
export class Quotas {
  constructor(private readonly http: Http) {}

  /** Create the quota full or change it (`limit` tokens per `periodMs`; needs `resource_config`; refused to a key bound to a run). */
  put(name: string, options: { limit: number; periodMs: number }): Promise<QuotaData> {
    return this.http.request<QuotaData>('PUT', `/quotas/${segment(name)}`, {
      idempotent: true,
      body: { limit: options.limit, periodMs: options.periodMs },
    });
  }

  /** Return the quota with the tokens it holds now (refused to a key bound to a run: the level is the whole project's use). */
  get(name: string): Promise<QuotaData> {
    return this.http.request<QuotaData>('GET', `/quotas/${segment(name)}`, { idempotent: true });
  }

  /**
   * Take `amount` tokens (default 1) for work under the run; wait up to `waitMs` for them.
   *
   * Throws `ConflictError` with code `QUOTA_EXHAUSTED` (`details.retryAfterMs`) when they are not
   * there in time, and the run's error (`ScopeCancelledError`...) when it is inactive. Never
   * retried after a lost answer: a repeat could take twice.
   */
  async take(name: string, options: QuotaTakeOptions = {}): Promise<QuotaTake> {
    const runId = options.runId || process.env['RUNSTATE_SCOPE_ID'];
    if (!runId) throw new Error('No run id: pass runId, or set RUNSTATE_SCOPE_ID.');
    const waitMs = options.waitMs ?? 0;
    if (waitMs < 0) throw new RangeError('waitMs must be >= 0');
    const deadline = Date.now() + waitMs;
    for (;;) {
      const chunkMs = Math.min(Math.max(0, deadline - Date.now()), MAX_SERVER_WAIT_MS);
      try {
        return await this.http.request<QuotaTake>('POST', `/quotas/${segment(name)}/take`, {
          idempotent: false,
          body: { runId, amount: options.amount ?? 1, waitMs: chunkMs },
          waitMs: chunkMs,
        });
      } catch (error) {
        const retryMs = error instanceof ConflictError ? error.details['retryAfterMs'] : undefined;
        const leftMs = deadline - Date.now();
        if (!(error instanceof ConflictError) || error.code !== 'QUOTA_EXHAUSTED') throw error;
        if (typeof retryMs !== 'number' || leftMs <= 0 || retryMs > leftMs) throw error;
      }
    }
  }
}
