/**
 * A cancel reaches running handlers through the claim watch, not at the next renewal (issue 38).
 *
 * Every mailbox here has a ten-minute lease: renewal would come after 200 s, past every wait of
 * these tests, so a handler whose signal aborts was told by the watch.
 */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { Runstate, type TaskContext } from '../src/index.js';
import { unique, until } from './support.js';

const LONG_LEASE_MS = 600_000;
const WAIT_MS = 60_000;

/** Start a worker of `count` slots on `count` tasks whose handlers wait for their signal. */
async function busyWorker(count: number) {
  const rs = new Runstate();
  const mailbox = unique('push');
  await rs.mailboxes.ensure(mailbox, { mode: 'WORK', leaseTtlMs: LONG_LEASE_MS });
  const run = await rs.scopes.create();
  const tickets = [];
  for (let n = 0; n < count; n += 1) tickets.push(await run.tasks.submit(mailbox, { n }));
  const contexts = new Map<string, TaskContext>();
  const worker = run.worker(
    mailbox,
    async (context: TaskContext) => {
      contexts.set(context.taskId, context);
      await new Promise((resolve) => context.signal.addEventListener('abort', resolve, { once: true }));
      return { stopped: context.stopReason };
    },
    { concurrency: count, handleSignals: false, drainTimeoutMs: 100 },
  );
  const running = worker.run();
  await until(() => contexts.size === count, `${count} handlers running`, WAIT_MS);
  return { rs, run, tickets, contexts, worker, running };
}

describe('a cancel pushed to running handlers', { concurrency: true, timeout: 180_000 }, () => {
  test("a task cancel aborts its handler's signal at once, and no other's", async () => {
    const { tickets, contexts, worker, running } = await busyWorker(2);
    const [cancelled, other] = tickets as [(typeof tickets)[0], (typeof tickets)[0]];
    await cancelled.cancel({ reason: 'enough' });
    const task = await cancelled.result({ timeoutMs: WAIT_MS });
    const otherAborted = contexts.get(other.id)?.signal.aborted;
    worker.stop();
    await running;

    assert.equal(task.state, 'CANCELLED');
    assert.deepEqual(task.outcome, { stopped: 'cancellation_requested' });
    assert.equal(contexts.get(cancelled.id)?.stopReason, 'cancellation_requested');
    assert.equal(otherAborted, false);
  });

  test('a cancel pushed before the claim call answers aborts the handler when it starts', async () => {
    // The watch's frame and the claim's answer come on two connections: the frame may come first.
    // Forced: the claim's answer is held back until the watch has the frame of its task's cancel.
    const rs = new Runstate();
    const mailbox = unique('early');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK', leaseTtlMs: LONG_LEASE_MS });
    const run = await rs.scopes.create();
    const ticket = await run.tasks.submit(mailbox, { n: 0 });
    let stopReason: string | null = null;
    const worker = run.worker(
      mailbox,
      async (context: TaskContext) => {
        await new Promise((resolve) => {
          if (context.signal.aborted) resolve(undefined);
          context.signal.addEventListener('abort', resolve, { once: true });
        });
        stopReason = context.stopReason;
        return { stopped: context.stopReason };
      },
      { concurrency: 1, handleSignals: false, drainTimeoutMs: 100 },
    );
    type Claimed = { id: string; taskId: string };
    const internals = worker as unknown as {
      tasks: { claim: (...args: unknown[]) => Promise<Claimed[]> };
      early: Map<string, unknown>;
    };
    const claim = internals.tasks.claim.bind(internals.tasks);
    internals.tasks.claim = async (...args: unknown[]) => {
      const claims = await claim(...args);
      for (const claimed of claims) {
        assert.equal(claimed.taskId, ticket.id);
        await ticket.cancel({ reason: 'before the handler ran' });
        await until(() => internals.early.has(claimed.id), "the watch's frame of the cancel", WAIT_MS);
      }
      return claims;
    };
    const running = worker.run();
    const task = await ticket.result({ timeoutMs: WAIT_MS });
    worker.stop();
    await running;

    assert.equal(task.state, 'CANCELLED');
    assert.deepEqual(task.outcome, { stopped: 'cancellation_requested' });
    assert.equal(stopReason, 'cancellation_requested');
  });

  test('a run cancel aborts every busy slot (more than one claim call takes) and ends consume', async () => {
    // 120 slots: the server hands out 100 claims a call at most, so the worker fills them in two.
    const { rs, run, contexts, running } = await busyWorker(120);
    await rs.scope(run.id).cancel({ reason: 'stop everything' });
    const summary = await running;

    assert.equal(summary.stopReason, 'SCOPE_CANCELLED');
    assert.equal(summary.lost, 120);
    assert.deepEqual(new Set([...contexts.values()].map((context) => context.stopReason)), new Set(['scope_refused']));
  });
});
