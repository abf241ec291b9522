/**
 * The cancellation scenario of `shared/seeds/003_4e84a452e518ef9b.txt` (Runlane's "Cancel runs")
 * through the worker: a handler passes `context.signal` to a `fetch` against a slow local HTTP
 * server; a cancel request aborts that fetch in flight; a handler that returns is recorded
 * `CANCELLED`, one that throws after the request `FAILED`.
 */

import assert from 'node:assert/strict';
import { createServer, type IncomingMessage, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { after, before, describe, test } from 'node:test';

import {
  Runstate,
  task,
  type Handler,
  type Schema,
  type TaskContext,
  type TaskData,
  type TaskDefinition,
  type Ticket,
  type Worker,
} from '../src/index.js';
import { unique, until } from './support.js';

// Renewals every second: room for a slow request on a busy machine (or SQLite) before the lease runs out.
const LEASE_TTL_MS = 3000;

/** A search API that never answers a rebuild: it records each request and whether the client hung up. */
class SlowSearchApi {
  readonly requests: { path: string; abortedByClient: boolean }[] = [];
  private server: Server | null = null;
  url = '';

  async start(): Promise<void> {
    this.server = createServer((request: IncomingMessage) => {
      const entry = { path: request.url ?? '', abortedByClient: false };
      this.requests.push(entry);
      request.resume();
      // Never answers: only the client aborting ends the request.
      request.socket.on('close', () => {
        entry.abortedByClient = true;
      });
    });
    await new Promise<void>((resolve) => this.server?.listen(0, '127.0.0.1', resolve));
    this.url = `http://127.0.0.1:${(this.server.address() as AddressInfo).port}`;
  }

  async stop(): Promise<void> {
    this.server?.closeAllConnections();
    await new Promise<void>((resolve) => this.server?.close(() => resolve()));
  }
}

/** `z.object({ indexId: z.string() })`, without zod: any object with `parse()` does. */
const rebuildInput: Schema<{ indexId: string }> = {
  parse(input: unknown) {
    const indexId = (input as { indexId?: unknown } | null)?.indexId;
    if (typeof indexId !== 'string') throw new TypeError('indexId: expected a string');
    return { indexId };
  },
};

const api = new SlowSearchApi();
const env = { SEARCH_API_URL: '' };
const seen: { context?: TaskContext<{ indexId: string }>; error?: unknown } = {};

/** The handler of the seed, as written there (with `rethrow` deciding the "unrelated failure" path). */
function rebuildIndex(cooperate: boolean) {
  return task({
    id: 'search.rebuild-index',
    schema: rebuildInput,
    async run({ indexId }, context) {
      seen.context = context;
      if (context.isCancellationRequested()) return;

      try {
        const response = await fetch(new URL(`/indexes/${encodeURIComponent(indexId)}/rebuild`, env.SEARCH_API_URL), {
          method: 'POST',
          signal: context.signal,
        });
        if (!response.ok) throw new Error(`Search API returned ${response.status}`);
      } catch (cause) {
        seen.error = cause;
        if (cooperate && context.isCancellationRequested()) return;
        throw cause;
      }
    },
  });
}

/** The same handler as a plain function that destructures its context: the methods work detached. */
function rebuildIndexDestructured() {
  return async ({ input, signal, isCancellationRequested, throwIfCancellationRequested }: TaskContext<unknown>) => {
    const { indexId } = rebuildInput.parse(input);
    throwIfCancellationRequested();
    try {
      const response = await fetch(new URL(`/indexes/${encodeURIComponent(indexId)}/rebuild`, env.SEARCH_API_URL), {
        method: 'POST',
        signal,
      });
      if (!response.ok) throw new Error(`Search API returned ${response.status}`);
    } catch (cause) {
      seen.error = cause;
      if (isCancellationRequested()) return;
      throw cause;
    }
  };
}

async function scenario(
  cooperate: boolean,
  handler: Handler | TaskDefinition<{ indexId: string }> = rebuildIndex(cooperate),
): Promise<{ requested: TaskData; task: TaskData; summary: Awaited<ReturnType<Worker['run']>> }> {
  const rs = new Runstate();
  const mailbox = unique('search');
  await rs.mailboxes.ensure(mailbox, { mode: 'WORK', leaseTtlMs: LEASE_TTL_MS });
  const run = await rs.scopes.create();
  const ticket: Ticket = await run.tasks.submit(mailbox, { indexId: 'products/en' });
  const worker = run.worker(mailbox, handler, { handleSignals: false });
  const running = worker.run();
  const before = api.requests.length;
  await until(() => api.requests.length > before, 'the handler to call the search API');
  try {
    const requested = await ticket.cancel({ reason: 'customer_deleted_project' });
    const recorded = await ticket.result({ timeoutMs: 20_000 });
    worker.stop();
    return { requested, task: recorded, summary: await running };
  } finally {
    worker.stop();
  }
}

describe('Runlane: cancel runs (cooperative cancellation through context.signal)', { timeout: 180_000 }, () => {
  before(async () => {
    await api.start();
    env.SEARCH_API_URL = api.url;
  });
  after(() => api.stop());

  test('a cancel request aborts the fetch in flight, and the handler that returns is recorded CANCELLED', async () => {
    const { requested, task, summary } = await scenario(true);

    assert.equal(requested.state, 'CANCELLATION_REQUESTED'); // the intermediate state, before the worker sees it
    assert.equal(task.state, 'CANCELLED');
    assert.equal(task.cancelReason, 'customer_deleted_project');
    assert.equal(task.outcome, null);
    assert.equal(task.attempts, 1);
    const last = api.requests.at(-1);
    assert.equal(last?.path, '/indexes/products%2Fen/rebuild');
    // The fetch was aborted, not answered (the API never answers): the server hears the socket
    // close on a later turn of the event loop, which may come after the task was recorded.
    await until(() => last?.abortedByClient === true, 'the search API to see the fetch aborted');
    assert.ok(seen.context?.signal.aborted);
    assert.equal(seen.context?.stopReason, 'cancellation_requested');
    assert.equal((seen.error as Error).name, 'AbortError');
    assert.deepEqual(summary, { completed: 1, failed: 0, lost: 0, released: 0, stopReason: 'stopped' });
  });

  test('a handler that destructures its context cooperates the same way and is recorded CANCELLED', async () => {
    const { task, summary } = await scenario(true, rebuildIndexDestructured());

    assert.equal(task.state, 'CANCELLED');
    assert.equal(task.attempts, 1);
    await until(() => api.requests.at(-1)?.abortedByClient === true, 'the search API to see the fetch aborted');
    assert.equal((seen.error as Error).name, 'AbortError');
    assert.deepEqual(summary, { completed: 1, failed: 0, lost: 0, released: 0, stopReason: 'stopped' });
  });

  test('a handler that throws after the cancel request is recorded FAILED, not CANCELLED, and not retried', async () => {
    const { task, summary } = await scenario(false);

    assert.equal(task.state, 'FAILED');
    assert.equal(task.attempts, 1);
    assert.equal((task.error as { type: string }).type, 'AbortError');
    await until(() => api.requests.at(-1)?.abortedByClient === true, 'the search API to see the fetch aborted');
    assert.deepEqual(summary, { completed: 0, failed: 1, lost: 0, released: 0, stopReason: 'stopped' });
  });

  test('input the schema refuses fails the task without a retry', async () => {
    const rs = new Runstate();
    const mailbox = unique('search-invalid');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK', maxAttempts: 3 });
    const run = await rs.scopes.create();
    const ticket = await run.tasks.submit(mailbox, { indexId: 42 });
    const worker = run.worker(mailbox, rebuildIndex(true), { handleSignals: false, claimWaitMs: 1_000 });
    const running = worker.run();
    const failed = await ticket.result({ timeoutMs: 10_000 });
    worker.stop();
    const summary = await running;

    assert.equal(failed.state, 'FAILED');
    assert.equal(failed.attempts, 1);
    assert.deepEqual(
      { type: (failed.error as { type: string }).type, message: (failed.error as { message: string }).message },
      { type: 'InputValidationError', message: 'indexId: expected a string' },
    );
    assert.equal(summary.failed, 1);
  });

  test('a run cancelled under a running handler aborts its signal and stops consume', async () => {
    const rs = new Runstate();
    const mailbox = unique('search-doomed');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK', leaseTtlMs: LEASE_TTL_MS });
    const run = await rs.scopes.create();
    const ticket = await run.tasks.submit(mailbox, { indexId: 'doomed' });
    const before = api.requests.length;
    const consuming = run.consume(mailbox, rebuildIndex(true), { handleSignals: false });
    await until(() => api.requests.length > before, 'the handler to call the search API');
    await rs.scope(run.id).cancel({ reason: 'stop everything' });
    const summary = await consuming;

    assert.equal(summary.stopReason, 'SCOPE_CANCELLED');
    assert.equal(summary.lost, 1);
    assert.equal(summary.completed, 0);
    assert.ok(seen.context?.signal.aborted);
    assert.equal(seen.context?.stopReason, 'scope_refused');
    await until(() => api.requests.at(-1)?.abortedByClient === true, 'the fetch to be aborted');
    assert.equal((await ticket.status()).state, 'CANCELLED');
  });
});
