/** `Runstate`: the client and its top-level namespaces. */

import { Budgets } from './budgets.js';
import { Barriers, Timers } from './clock.js';
import { TransportError } from './errors.js';
import { Groups } from './groups.js';
import { Http, MAX_SERVER_WAIT_MS, buildConfig, compact, segment, sleep, type ClientConfig, type RunstateOptions } from './http.js';
import { Pools } from './pools.js';
import { Quotas } from './quotas.js';
import { Scope, Scopes } from './scopes.js';
import type { EventData, EventPage, Mailbox, MailboxMode } from './types.js';
import { Messages, Tasks } from './work.js';

/** `rs.mailboxes`: ensure and read mailboxes. */
export class Mailboxes {
  constructor(private readonly http: Http) {}

  /** Ensure the mailbox exists with `mode` (`WORK` or `QUEUE`); idempotent, needs `resource_config`; refused to a key bound to a run. */
  ensure(name: string, options: { mode: MailboxMode; leaseTtlMs?: number; maxAttempts?: number }): Promise<Mailbox> {
    return this.http.request('PUT', `/mailboxes/${segment(name)}`, {
      idempotent: true,
      body: compact({ mode: options.mode, leaseTtlMs: options.leaseTtlMs, maxAttempts: options.maxAttempts }),
    });
  }

  /** Return the mailbox: `name, mode, leaseTtlMs, maxAttempts, createdAt`. */
  retrieve(name: string): Promise<Mailbox> {
    return this.http.request('GET', `/mailboxes/${segment(name)}`, { idempotent: true });
  }
}

export interface EventFilter {
  /** Event types (`task.cancelled`...), as a list or comma-separated. */
  types?: string | readonly string[];
  /** That run and every run below it. */
  runId?: string;
}

function typesParam(types: string | readonly string[] | undefined): string | undefined {
  if (types === undefined) return undefined;
  return typeof types === 'string' ? types : types.join(',');
}

/** `rs.events`: the cursor-paged event log, followed by long-polls or by Server-Sent Events. */
export class Events {
  constructor(private readonly http: Http) {}

  /**
   * Return the events after the cursor `after`, oldest first: `{ events, nextCursor }`.
   *
   * With `waitMs` (30 s at most), an empty page waits that long for the next event.
   * `nextCursor` is never null: pass it as `after` to continue.
   */
  list(options: EventFilter & { after?: string; limit?: number; waitMs?: number; signal?: AbortSignal } = {}): Promise<EventPage> {
    const wait = options.waitMs ? Math.min(options.waitMs, MAX_SERVER_WAIT_MS) : 0;
    return this.http.request('GET', '/events', {
      signal: options.signal,
      idempotent: true,
      query: {
        after: options.after,
        types: typesParam(options.types),
        runId: options.runId,
        limit: options.limit,
        waitMs: wait || undefined,
      },
      waitMs: wait,
    });
  }

  /** Yield every event after `after` (from the start when omitted), then wait for new ones, until `signal` aborts. */
  async *follow(
    options: EventFilter & { after?: string; limit?: number; signal?: AbortSignal } = {},
  ): AsyncGenerator<EventData> {
    let cursor = options.after;
    while (!options.signal?.aborted) {
      let page: EventPage;
      try {
        page = await this.list({ ...options, after: cursor, waitMs: MAX_SERVER_WAIT_MS });
      } catch (error) {
        if (options.signal?.aborted) return;
        throw error;
      }
      for (const event of page.events) {
        if (options.signal?.aborted) return;
        yield event;
      }
      cursor = page.nextCursor;
    }
  }

  /**
   * Yield events from the Server-Sent Events stream (`GET /v1/events/stream`), until `signal` aborts.
   *
   * Starts after the cursor `after`, or with new events only when omitted. A dropped connection
   * is resumed from the last event received (`Last-Event-ID`), so nothing is skipped or repeated;
   * errors answered by the server (401, 403, 404...) are thrown. Also `for await (const e of rs.events)`.
   */
  async *stream(options: EventFilter & { after?: string; signal?: AbortSignal } = {}): AsyncGenerator<EventData> {
    const query = compact({ types: typesParam(options.types), runId: options.runId });
    let lastId = options.after ?? null;
    let failures = 0;
    while (!options.signal?.aborted) {
      try {
        for await (const event of this.http.eventStream<EventData>('/events/stream', query, lastId, options.signal)) {
          lastId = event.id;
          failures = 0;
          yield event;
        }
      } catch (error) {
        if (options.signal?.aborted) return;
        if (!(error instanceof TransportError)) throw error;
        failures += 1;
        await sleep(Math.min(100 * 2 ** failures, 5_000), options.signal).catch(() => undefined);
      }
    }
  }

  /** `for await (const event of rs.events)`: the Server-Sent Events stream of new events. */
  [Symbol.asyncIterator](): AsyncGenerator<EventData> {
    return this.stream();
  }
}

/**
 * The client: `new Runstate({ url?, apiKey? })`, from `RUNSTATE_URL` and `RUNSTATE_API_KEY` by default.
 *
 * One client shares Node's connection pool for every call; it holds nothing to close.
 */
export class Runstate {
  readonly config: ClientConfig;
  readonly mailboxes: Mailboxes;
  readonly scopes: Scopes;
  readonly events: Events;
  /** Look-ups that need no run; creating barriers, timers, tasks and messages goes through a run. */
  readonly groups: Groups;
  readonly tasks: Tasks;
  readonly messages: Messages;
  readonly barriers: Barriers;
  readonly timers: Timers;
  readonly pools: Pools;
  readonly quotas: Quotas;
  readonly budgets: Budgets;
  private readonly http: Http;

  constructor(options: RunstateOptions = {}) {
    this.config = buildConfig(options);
    this.http = new Http(this.config, options.fetch);
    this.mailboxes = new Mailboxes(this.http);
    this.scopes = new Scopes(this.http);
    this.events = new Events(this.http);
    this.groups = new Groups(this.http);
    this.tasks = new Tasks(this.http, null);
    this.messages = new Messages(this.http, null);
    this.barriers = new Barriers(this.http, null);
    this.timers = new Timers(this.http, null);
    this.pools = new Pools(this.http);
    this.quotas = new Quotas(this.http);
    this.budgets = new Budgets(this.http, null);
  }

  /** Return a handle on the run `scopeId` (default `RUNSTATE_SCOPE_ID`); no request is sent. */
  scope(scopeId?: string): Scope {
    const id = scopeId || process.env['RUNSTATE_SCOPE_ID'];
    if (!id) throw new Error('No run id: pass one, or set RUNSTATE_SCOPE_ID.');
    return new Scope(this.http, id);
  }

  /** Return `/v1/healthz` (needs no key). */
  health(): Promise<{ status: string }> {
    return this.http.request('GET', '/healthz', { idempotent: true });
  }
}
