/** `run.admissions` against the live service: the line, waits, withdraw and the parent's cancel. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { ConflictError, Runstate, ScopeCancelledError } from '../src/index.js';

describe('admissions', () => {
  test('at most maxActive admitted; a waiter is admitted when a child ends; withdraw leaves the line', async () => {
    const rs = new Runstate();
    const job = await rs.scopes.create({ name: 'job' });
    const config = await job.admissions.configure({ maxActive: 1 });
    assert.deepEqual([config.maxActive, config.admitted, config.waiting], [1, 0, 0]);
    const first = await job.admissions.request({ name: 'agent-1' });
    assert.equal(first.state, 'ADMITTED');
    assert.equal(first.run?.parentId, job.id);
    const second = await job.admissions.request({ name: 'agent-2', waitMs: 50 });
    assert.deepEqual([second.state, second.position, second.run], ['WAITING', 1, null]);
    const third = await job.admissions.request({ name: 'agent-3' });
    assert.equal(third.position, 2);
    const waiting = second.wait({ waitMs: 10_000 });
    await new Promise((resolve) => setTimeout(resolve, 200));
    await rs.scope(first.run!.id).complete();
    const admitted = await waiting;
    assert.equal(admitted.state, 'ADMITTED');
    assert.equal(admitted.run?.name, 'agent-2');
    assert.equal((await third.withdraw()).state, 'WITHDRAWN');
    await assert.rejects(second.withdraw(), (error: unknown) => {
      assert.ok(error instanceof ConflictError);
      assert.equal(error.code, 'INVALID_STATE');
      return true;
    });
    assert.equal((await job.admissions.get(second.id).status()).state, 'ADMITTED');
    assert.equal((await job.admissions.status()).admitted, 1);
  });

  test("cancelling the parent answers a waiter with the run's code", async () => {
    const rs = new Runstate();
    const job = await rs.scopes.create();
    await job.admissions.configure({ maxActive: 1 });
    await job.admissions.request();
    const waiter = await job.admissions.request({ key: 'w' });
    assert.equal(waiter.state, 'WAITING');
    // The refusal is expected from the start: the wait may be answered before cancel() is,
    // and a rejection with no handler yet would fail the test as unhandled.
    const refused = assert.rejects(waiter.wait({ waitMs: 10_000 }), ScopeCancelledError);
    await new Promise((resolve) => setTimeout(resolve, 200));
    await job.cancel();
    await refused;
    assert.equal((await waiter.status()).state, 'CANCELLED');
    await assert.rejects(job.admissions.request(), ScopeCancelledError);
  });
});
