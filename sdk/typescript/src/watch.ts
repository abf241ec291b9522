/**
 * The claim watch: what stops this worker's claims, pushed by the server (`GET /v1/claims/watch`).
 *
 * One connection per worker loop, whatever its number of claims: the server sends the events that
 * stop a claim taken with this loop's `workerId` (a task cancel, a run or group end, a deadline, a
 * lease that ran out), and `onEvent` aborts the handler's signal at once instead of at the next
 * renewal. The watch keeps the cursor of the last frame it received (the opening `watch.ready`
 * frame's included) and reconnects with it, so a dropped connection or a restarted API process
 * costs no cancel. Renewal still reports a cancel: the fallback while the watch is down, and the
 * only channel against a server without a watch (404) or a key refused one (401/403), where the
 * watch gives up. The Python SDK's twin is `runstate/_worker/watch.py`.
 */

import { RunstateError } from './errors.js';
import { Http, sleep } from './http.js';
import { isTransient, type LoopLog } from './loop.js';

const PATH = '/claims/watch';
/** How long a worker loop waits for its watch to open before it claims anyway. */
export const READY_TIMEOUT_MS = 5_000;
const MAX_BACKOFF_MS = 2_000;

/** A frame of the watch: an event (`id`, `type`, `data`), or `watch.ready` (`workerId`, `after`). */
interface WatchFrame {
  id?: string;
  type?: string;
  data?: Record<string, unknown>;
  after?: string;
}

export type WatchListener = (type: string, claimId: string, data: Record<string, unknown>) => void;

export class ClaimWatch {
  /** The last frame's id: where a reconnection resumes. */
  cursor: string | null = null;
  connections = 0;
  /** Resolves once the first connection is open (or the watch gave up). */
  readonly ready: Promise<void>;
  private markReady: () => void = () => undefined;

  constructor(
    private readonly http: Http,
    readonly workerId: string,
    private readonly onEvent: WatchListener,
    private readonly log: LoopLog,
  ) {
    this.ready = new Promise((resolve) => {
      this.markReady = resolve;
    });
  }

  /** Watch, reconnecting with the cursor, until `signal` aborts or the server refuses the watch for good. */
  async run(signal: AbortSignal): Promise<void> {
    let failures = 0;
    while (!signal.aborted) {
      try {
        for await (const frame of this.http.eventStream<WatchFrame>(PATH, { workerId: this.workerId }, this.cursor, signal)) {
          failures = 0;
          this.received(frame);
        }
        failures += 1; // the server ended the stream (a restart): reconnect, not in a tight loop
      } catch (error) {
        if (signal.aborted) return;
        if (error instanceof RunstateError && !isTransient(error)) {
          this.log('warn', `claim watch unavailable (${String(error)}); cancels reach handlers at renewal`);
          this.markReady();
          return;
        }
        failures += 1;
        this.log('info', `claim watch dropped (${String(error)}); reconnecting`);
      }
      try {
        await sleep(Math.min(50 * 2 ** Math.max(failures - 1, 0), MAX_BACKOFF_MS), signal);
      } catch {
        return;
      }
    }
  }

  private received(frame: WatchFrame): void {
    if (frame.type === undefined) {
      // `watch.ready` (its cursor is `after`) or `stream.dropped` (no cursor: resume as before).
      if (typeof frame.after === 'string') {
        this.cursor = frame.after;
        this.connections += 1;
        this.markReady();
      }
      return;
    }
    if (frame.id !== undefined) this.cursor = frame.id;
    const data = frame.data ?? {};
    if (typeof data.claimId === 'string') this.onEvent(frame.type, data.claimId, data);
  }
}
