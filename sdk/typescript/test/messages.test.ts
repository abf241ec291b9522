/**
 * The message loop (`consumeMessages`) against the live service: the scenarios of the Python
 * loop's tests (tests/sdk/test_consume_messages.py): answers, extends, loss, stop, and a poison
 * message dead-lettered after `maxAttempts`.
 */

import assert from 'node:assert/strict';
import { once } from 'node:events';
import { describe, test } from 'node:test';

import {
  Reject,
  Runstate,
  type EventData,
  type MessageContext,
  type MessageData,
  type MessageSummary,
  type MessageWorker,
} from '../src/index.js';
import { consumerProcess, requiredEnv, unique, until } from './support.js';

// Extends every 2/3 s: a handler outliving it needs several, and a loaded machine still has
// over a second to get each one through before the visibility runs out.
const VISIBILITY_MS = 2_000;

async function queueWith(rs: Runstate, prefix: string, bodies: unknown[], options: { maxAttempts?: number } = {}) {
  const mailbox = unique(prefix);
  await rs.mailboxes.ensure(mailbox, { mode: 'QUEUE', ...options });
  const run = await rs.scopes.create();
  const sent: MessageData[] = [];
  for (const body of bodies) sent.push(await run.messages.send(mailbox, body));
  return { mailbox, run, sent };
}

/** The run's events about `subjectId`, oldest first, up to the first of type `last` (waited for). */
async function eventsUntil(rs: Runstate, runId: string, subjectId: string, last: string): Promise<EventData[]> {
  const seen: EventData[] = [];
  for await (const event of rs.events.follow({ runId, signal: AbortSignal.timeout(30_000) })) {
    if (event.subjectId === subjectId) seen.push(event);
    if (event.type === last && (event.subjectId === subjectId || last.startsWith('run.'))) return seen;
  }
  assert.fail(`no ${last} event for ${subjectId}`);
}

/** Another party answers the delivery (a retry delayed 60 s), over the API itself. */
async function retryElsewhere(deliveryId: string): Promise<void> {
  const url = `${requiredEnv('RUNSTATE_URL').replace(/\/+$/, '').replace(/\/v1$/, '')}/v1/deliveries/${deliveryId}/retry`;
  const response = await fetch(url, {
    method: 'POST',
    headers: { Authorization: `Bearer ${requiredEnv('RUNSTATE_API_KEY')}`, 'Content-Type': 'application/json' },
    body: JSON.stringify({ delayMs: 60_000 }),
  });
  assert.equal(response.status, 200, await response.text());
}

/**
 * Send one message, start a message loop on it in a child process, SIGTERM it once its handler
 * started; return the summary line it printed, its exit code and the message afterwards.
 */
async function sigtermed(
  prefix: string,
  options: { leaseTtlMs: number; mode: 'hang' | 'finish'; drainMs?: number },
): Promise<{ summary: string; code: number | null; message: MessageData }> {
  const rs = new Runstate();
  const mailbox = unique(prefix);
  await rs.mailboxes.ensure(mailbox, { mode: 'QUEUE', leaseTtlMs: options.leaseTtlMs });
  const run = await rs.scopes.create();
  const sent = await run.messages.send(mailbox, { job: 1 });
  const consumer = consumerProcess(run.id, mailbox, options.mode, { loop: 'messages', ...options });
  try {
    assert.equal(await consumer.next(), `received ${sent.id} 1`);
    consumer.child.kill('SIGTERM');
    const summary = await consumer.next();
    const [code] = (await once(consumer.child, 'exit')) as [number | null];
    return { summary, code, message: await rs.messages.retrieve(sent.id) };
  } finally {
    if (consumer.child.exitCode === null && consumer.child.signalCode === null) consumer.child.kill('SIGKILL');
  }
}

/** Run `worker` until `done(summary)` holds, then stop it; return its summary. */
async function runUntil(worker: MessageWorker, done: (summary: MessageSummary) => boolean, what: string) {
  const running = worker.run();
  await until(() => done(worker.summary), what);
  worker.stop();
  return running;
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('consumeMessages', { concurrency: true, timeout: 240_000 }, () => {
  test('Reject is exported and carries its reason', () => {
    assert.equal(new Reject('bad input').reason, 'bad input');
    assert.equal(new Reject().reason, null);
    assert.ok(new Reject('x') instanceof Error);
  });

  test('handlers returning complete every message once', async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(
      rs,
      'done',
      Array.from({ length: 10 }, (_, n) => ({ n })),
    );
    const seen: [string, string, number, number][] = [];
    const worker = run.messageWorker(
      mailbox,
      async ({ messageId, deliveryId, attempt, body }: MessageContext<{ n: number }>) => {
        seen.push([messageId, deliveryId, attempt, body.n]);
        await sleep(10);
        return 'ok';
      },
      { concurrency: 3, handleSignals: false },
    );
    const summary = await runUntil(worker, (done) => done.completed >= 10, '10 completions');

    assert.deepEqual(
      seen.map(([, , , n]) => n).sort((a, b) => a - b),
      Array.from({ length: 10 }, (_, n) => n),
    );
    assert.deepEqual(new Set(seen.map(([messageId]) => messageId)), new Set(sent.map((message) => message.id)));
    assert.ok(seen.every(([, deliveryId, attempt]) => attempt === 1 && deliveryId.startsWith('d_')));
    assert.deepEqual(summary, {
      completed: 10,
      retried: 0,
      rejected: 0,
      deadLettered: 0,
      lost: 0,
      released: 0,
      stopReason: 'stopped',
    });
    const rows = await Promise.all(sent.map((message) => rs.messages.retrieve(message.id)));
    assert.deepEqual(new Set(rows.map((row) => `${row.state} ${row.attempts}`)), new Set(['COMPLETED 1']));
  });

  test('a throw retries after the delay and the message comes back as attempt 2', async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(rs, 'flaky', [{ job: 1 }]);
    const message = sent[0]!;
    const attempts: number[] = [];
    const worker = run.messageWorker(
      mailbox,
      ({ attempt }) => {
        attempts.push(attempt);
        if (attempt === 1) throw new Error('first try fails');
        return 'ok';
      },
      { retryDelayMs: 300, handleSignals: false, log: () => undefined },
    );
    const summary = await runUntil(worker, (done) => done.completed >= 1, 'the second attempt');

    assert.deepEqual(attempts, [1, 2]);
    assert.deepEqual([summary.retried, summary.completed], [1, 1]);
    const row = await rs.messages.retrieve(message.id);
    assert.deepEqual([row.state, row.attempts], ['COMPLETED', 2]);
    const events = await eventsUntil(rs, run.id, message.id, 'message.completed');
    const retried = events.find((event) => event.type === 'message.retried');
    assert.equal(retried?.data['delayMs'], 300);
  });

  test('Reject dead-letters the message with its reason', async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(rs, 'poison', [{ job: 'bad' }]);
    const message = sent[0]!;
    const worker = run.messageWorker(
      mailbox,
      (context: MessageContext<{ job: string }>) => {
        throw new Reject(`cannot parse ${context.body.job}`);
      },
      { handleSignals: false },
    );
    const summary = await runUntil(worker, (done) => done.rejected >= 1, 'the reject');

    assert.deepEqual([summary.rejected, summary.retried, summary.completed], [1, 0, 0]);
    const row = await rs.messages.retrieve(message.id);
    assert.deepEqual([row.state, row.deadLetterReason, row.attempts], ['DEAD_LETTERED', 'cannot parse bad', 1]);
  });

  test('a message whose handler throws on every delivery is dead-lettered after maxAttempts', async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(rs, 'exhausted', [{ job: 1 }], { maxAttempts: 2 });
    const message = sent[0]!;
    const attempts: number[] = [];
    const worker = run.messageWorker(
      mailbox,
      ({ attempt }) => {
        attempts.push(attempt);
        throw new Error('always fails');
      },
      { handleSignals: false, log: () => undefined },
    );
    const summary = await runUntil(worker, (done) => done.deadLettered >= 1, 'the dead letter');

    assert.deepEqual(attempts, [1, 2]);
    assert.deepEqual([summary.retried, summary.deadLettered, summary.rejected, summary.completed], [1, 1, 0, 0]);
    const row = await rs.messages.retrieve(message.id);
    assert.deepEqual([row.state, row.deadLetterReason, row.attempts], ['DEAD_LETTERED', 'max_attempts', 2]);
    const events = await eventsUntil(rs, run.id, message.id, 'message.dead_lettered');
    assert.deepEqual(events.at(-1)?.data, { attempt: 2, reason: 'max_attempts' });
  });

  test("background extends keep a slow handler's message from redelivery", async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(rs, 'slow', [{ job: 1 }]);
    const message = sent[0]!;
    const calls: number[] = [];
    // concurrency 2: a free slot keeps receiving, so a redelivery would reach this worker.
    const worker = run.messageWorker(
      mailbox,
      async ({ attempt }) => {
        calls.push(attempt);
        await sleep(VISIBILITY_MS * 3);
        return 'ok';
      },
      { concurrency: 2, visibilityMs: VISIBILITY_MS, receiveWaitMs: 200, handleSignals: false },
    );
    const summary = await runUntil(worker, (done) => done.completed >= 1, 'the slow handler');

    assert.deepEqual(calls, [1]);
    assert.deepEqual([summary.completed, summary.lost], [1, 0]);
    const row = await rs.messages.retrieve(message.id);
    assert.deepEqual([row.state, row.attempts], ['COMPLETED', 1]);
    const events = await eventsUntil(rs, run.id, message.id, 'message.completed');
    assert.equal(events.filter((event) => event.type === 'message.received').length, 1);
  });

  test('a delivery answered elsewhere is lost at the next extend', async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(rs, 'taken', [{ job: 1 }]);
    const message = sent[0]!;
    let seen: MessageContext | null = null;
    let signalled = false;
    const worker = run.messageWorker(
      mailbox,
      async (context) => {
        seen = context;
        await new Promise((resolve) => context.signal.addEventListener('abort', resolve, { once: true }));
        signalled = true;
        return 'too late';
      },
      { visibilityMs: VISIBILITY_MS, handleSignals: false },
    );
    const running = worker.run();
    await until(() => seen !== null, 'the handler');
    await retryElsewhere((seen as MessageContext | null)!.deliveryId);
    await until(() => worker.summary.lost >= 1, 'the lost delivery');
    worker.stop();
    const summary = await running;

    const context = (seen as MessageContext | null)!;
    assert.deepEqual([summary.lost, summary.completed, summary.retried], [1, 0, 0]);
    assert.ok(context.isLost() && context.lost && context.signal.aborted);
    assert.equal(context.stopReason, 'lease_lost');
    await until(() => signalled, 'the handler to see its signal');
    const row = await rs.messages.retrieve(message.id);
    assert.deepEqual([row.state, row.attempts], ['QUEUED', 1]); // the other party's retry stands; nothing more was sent
  });

  test('cancelling the run mid-handler loses the delivery and stops the loop (destructured context)', async () => {
    const rs = new Runstate();
    const { mailbox, run, sent } = await queueWith(rs, 'doomed', [{ job: 1 }]);
    const message = sent[0]!;
    let started = false;
    const checks: { lost?: boolean; cancellationRequested?: boolean; reason?: unknown } = {};
    const consuming = new Runstate().scope(run.id).consumeMessages(
      mailbox,
      async ({ signal, isLost, isCancellationRequested }) => {
        started = true;
        await new Promise((resolve) => signal.addEventListener('abort', resolve, { once: true }));
        checks.lost = isLost();
        checks.cancellationRequested = isCancellationRequested();
        checks.reason = signal.reason;
        return 'too late';
      },
      { visibilityMs: VISIBILITY_MS, handleSignals: false },
    );
    await until(() => started, 'the handler');
    await rs.scope(run.id).cancel({ reason: 'stop everything' });
    const summary = await consuming;

    assert.equal(summary.stopReason, 'SCOPE_CANCELLED');
    assert.deepEqual([summary.lost, summary.completed, summary.retried], [1, 0, 0]);
    await until(() => checks.lost !== undefined, 'the handler to see its signal');
    assert.equal(checks.lost, true);
    assert.equal(checks.cancellationRequested, true);
    assert.ok(checks.reason instanceof DOMException && checks.reason.message.includes('scope refused'));
    // Nothing more was sent for it, and it was never delivered again.
    const row = await rs.messages.retrieve(message.id);
    assert.deepEqual([row.state, row.attempts], ['IN_FLIGHT', 1]);
    const events = await eventsUntil(rs, run.id, message.id, 'run.cancelled');
    assert.deepEqual(
      events.map((event) => event.type),
      ['message.sent', 'message.received'],
    );
  });

  test('SIGTERM lets the running handler finish and completes its message', async () => {
    const { summary, code, message } = await sigtermed('msg-sigterm', { leaseTtlMs: 3000, mode: 'finish' });
    assert.equal(summary, 'summary completed=1 retried=0 rejected=0 deadLettered=0 lost=0 released=0 stopReason=stopped');
    assert.equal(code, 0);
    assert.equal(message.state, 'COMPLETED');
  });

  test('SIGTERM puts back a message whose handler outlives the drain timeout', async () => {
    const { summary, code, message } = await sigtermed('msg-drained', { leaseTtlMs: 30_000, mode: 'hang', drainMs: 500 });
    assert.equal(summary, 'summary completed=0 retried=0 rejected=0 deadLettered=0 lost=0 released=1 stopReason=stopped');
    assert.equal(code, 0); // the hanging handler does not keep the process alive
    assert.deepEqual([message.state, message.attempts], ['QUEUED', 1]); // back in the queue at once, not after 30 s
  });
});
