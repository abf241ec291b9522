/** The worker loop (`consume`) against the live service: exactly once, takeover after SIGKILL, SIGTERM, bound keys. */

import assert from 'node:assert/strict';
import { once } from 'node:events';
import { describe, test } from 'node:test';

import { NotFoundError, Runstate, type TaskContext } from '../src/index.js';
import { consumerProcess, requiredEnv, unique, until } from './support.js';

async function prepare(rs: Runstate, mailbox: string, leaseTtlMs: number) {
  await rs.mailboxes.ensure(mailbox, { mode: 'WORK', leaseTtlMs });
  const run = await rs.scopes.create();
  const ticket = await run.tasks.submit(mailbox, { job: 1 });
  return { run, ticket };
}

describe('consume', { concurrency: true, timeout: 240_000 }, () => {
  test('two consumers drain 200 tasks exactly once', async () => {
    const rs = new Runstate();
    const mailbox = unique('drain');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create({ name: 'drain' });
    const tickets = await run.tasks.submitMany(
      mailbox,
      Array.from({ length: 200 }, (_, n) => ({ input: { n }, key: `n-${n}` })),
    );
    const handled: [string, number][] = [];
    const workers = [0, 1].map((index) =>
      new Runstate().scope(run.id).worker(
        mailbox,
        async (context: TaskContext) => {
          handled.push([context.taskId, index]);
          await new Promise((resolve) => setTimeout(resolve, Math.random() * 5));
          return { n: (context.input as { n: number }).n, worker: index };
        },
        { concurrency: 4, handleSignals: false },
      ),
    );
    const running = workers.map((worker) => worker.run());
    await until(() => workers.reduce((sum, worker) => sum + worker.summary.completed, 0) >= 200, '200 tasks', 120_000);
    for (const worker of workers) worker.stop();
    const summaries = await Promise.all(running);

    assert.equal(handled.length, 200);
    assert.equal(new Set(handled.map(([taskId]) => taskId)).size, 200);
    assert.equal(new Set(handled.map(([, index]) => index)).size, 2); // both took part
    for (const summary of summaries) {
      assert.deepEqual({ ...summary, completed: 0 }, { completed: 0, failed: 0, lost: 0, released: 0, stopReason: 'stopped' });
    }
    const results = await Promise.all(tickets.map((ticket) => ticket.status()));
    assert.deepEqual(new Set(results.map((task) => `${task.state} ${task.attempts}`)), new Set(['SUCCEEDED 1']));
    assert.deepEqual(
      results.map((task) => (task.outcome as { n: number }).n),
      Array.from({ length: 200 }, (_, n) => n),
    );
  });

  test('a TypeScript consumer killed with SIGKILL mid-task has its task taken over by another', async () => {
    const rs = new Runstate();
    const mailbox = unique('takeover');
    const { run, ticket } = await prepare(rs, mailbox, 1000);
    const consumer = consumerProcess(run.id, mailbox, 'hang');
    try {
      assert.equal(await consumer.next(), `claimed ${ticket.id} 1`);
      consumer.child.kill('SIGKILL');
      await once(consumer.child, 'exit');
    } finally {
      if (consumer.child.exitCode === null && consumer.child.signalCode === null) consumer.child.kill('SIGKILL');
    }
    assert.equal((await ticket.status()).state, 'RUNNING'); // the dead worker's lease still holds it

    let attempt = 0;
    // Its own claim holds 30 s: on a loaded machine a claim of the mailbox's 1 s lease could
    // run out before its completion arrived, and a third attempt would take the task over.
    const worker = rs.scope(run.id).worker(
      mailbox,
      (context) => {
        attempt = context.attempt;
        return { by: 'second' };
      },
      { handleSignals: false, leaseTtlMs: 30_000 },
    );
    const running = worker.run();
    const task = await ticket.result({ timeoutMs: 20_000 }); // the 1 s lease runs out, the next claim takes it
    worker.stop();
    await running;

    assert.equal(task.state, 'SUCCEEDED');
    assert.deepEqual(task.outcome, { by: 'second' });
    assert.equal(task.attempts, 2);
    assert.equal(attempt, 2);
  });

  test('SIGTERM lets the running handler finish and record its outcome', async () => {
    const rs = new Runstate();
    const mailbox = unique('sigterm');
    const { run, ticket } = await prepare(rs, mailbox, 3000);
    const consumer = consumerProcess(run.id, mailbox, 'finish');
    assert.equal(await consumer.next(), `claimed ${ticket.id} 1`);
    consumer.child.kill('SIGTERM');
    assert.equal(await consumer.next(), 'summary completed=1 failed=0 lost=0 released=0 stopReason=stopped');
    const [code] = (await once(consumer.child, 'exit')) as [number | null];
    assert.equal(code, 0);
    const task = await ticket.status();
    assert.equal(task.state, 'SUCCEEDED');
    assert.deepEqual(task.outcome, { mode: 'finish', stopReason: null });
  });

  test('SIGTERM releases a task whose handler outlives the drain timeout', async () => {
    const rs = new Runstate();
    const mailbox = unique('drained');
    const { run, ticket } = await prepare(rs, mailbox, 30_000);
    const consumer = consumerProcess(run.id, mailbox, 'hang', { drainMs: 500 });
    assert.equal(await consumer.next(), `claimed ${ticket.id} 1`);
    consumer.child.kill('SIGTERM');
    assert.equal(await consumer.next(), 'summary completed=0 failed=0 lost=0 released=1 stopReason=stopped');
    const [code] = (await once(consumer.child, 'exit')) as [number | null];
    assert.equal(code, 0); // the hanging handler does not keep the process alive
    const task = await ticket.status();
    assert.equal(task.state, 'QUEUED'); // back in the queue at once, not after the 30 s lease
    assert.equal(task.attempts, 1);
  });

  test("a bound key's worker sees only its run's subtree", async () => {
    const rs = new Runstate();
    const bound = new Runstate({ apiKey: requiredEnv('RUNSTATE_TEST_BOUND_API_KEY') });
    const boundRunId = requiredEnv('RUNSTATE_TEST_BOUND_RUN_ID');
    const mailbox = unique('bound');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const inside = await rs.scope(boundRunId).child({ name: 'inside' });
    const outside = await rs.scopes.create({ name: 'outside' });
    const mine = await inside.tasks.submit(mailbox, { where: 'inside' });
    const theirs = await outside.tasks.submit(mailbox, { where: 'outside' });

    const handled: unknown[] = [];
    const worker = bound.scope(inside.id).worker(
      mailbox,
      (context) => {
        handled.push(context.input);
        return { seen: context.input };
      },
      { handleSignals: false },
    );
    const running = worker.run();
    const done = await bound.tasks.get(mine.id).result({ timeoutMs: 20_000 });
    worker.stop();
    await running;
    assert.equal(done.state, 'SUCCEEDED');
    assert.deepEqual(handled, [{ where: 'inside' }]);

    // Outside its subtree, the bound key finds nothing: its worker cannot start, its reads are NOT_FOUND.
    await assert.rejects(
      bound.scope(outside.id).consume(mailbox, () => 'never', { handleSignals: false }),
      (error: unknown) => error instanceof NotFoundError && error.code === 'NOT_FOUND',
    );
    await assert.rejects(bound.tasks.get(theirs.id).status(), NotFoundError);
    await assert.rejects(bound.scope(outside.id).status(), NotFoundError);
    assert.equal((await theirs.status()).state, 'QUEUED');
    // Once the later submit is visible to a cursor reader (a moment on a busy cluster), so is the earlier one.
    for await (const event of rs.events.follow({ types: ['task.submitted'], runId: outside.id, signal: AbortSignal.timeout(60_000) })) {
      if (event.subjectId === theirs.id) break;
    }
    const page = await bound.events.list({ types: ['task.submitted'], limit: 1000 });
    const runs = new Set(page.events.map((event) => event.runId));
    assert.ok(runs.has(inside.id));
    assert.ok(!runs.has(outside.id));
  });
});
