/** Pools against the live server: put, acquire with background renewal, signal on loss, withLease. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import { PoolExhaustedError, Runstate, ScopeCancelledError } from '../src/index.js';
import { requiredEnv, unique, until } from './support.js';

requiredEnv('RUNSTATE_URL');

describe('pools', () => {
  test('acquire renews in the background, withLease releases, exhausted answers its details', async () => {
    const rs = new Runstate();
    const name = unique('gpu');
    assert.equal((await rs.pools.put(name, { capacity: 2 })).capacity, 2);
    const run = await rs.scopes.create();
    // A 2 s lease renewed every third of it: the test waits for two renewals it sees, never a
    // fixed time (a 300 ms lease was lost to a loaded machine's scheduling stall).
    await rs.pools.withLease(name, { runId: run.id, units: 2, leaseTtlMs: 2000 }, async (lease) => {
      const expiries = [lease.data.expiresAt];
      await until(() => {
        if (lease.data.expiresAt !== expiries.at(-1)) expiries.push(lease.data.expiresAt);
        return expiries.length > 2 || lease.lost;
      }, 'two renewals');
      assert.equal(lease.lost, false);
      assert.ok((await lease.status()).expiresAt > expiries[1]!);
      assert.equal((await rs.pools.retrieve(name)).inUse, 2);
      const refused = await rs.pools.acquire(name, { runId: run.id }).catch((error: unknown) => error);
      assert.ok(refused instanceof PoolExhaustedError);
      assert.equal(refused.code, 'POOL_EXHAUSTED');
      assert.deepEqual(refused.details, { capacity: 2, inUse: 2, waiting: 0 });
    });
    assert.equal((await rs.pools.retrieve(name)).inUse, 0);
  });

  test('a waiter is granted on release, and a cancel aborts the lease signal', async () => {
    const rs = new Runstate();
    const name = unique('gpu');
    await rs.pools.put(name, { capacity: 1 });
    const run = await rs.scopes.create();
    const held = await rs.pools.acquire(name, { runId: run.id, key: 'k1', leaseTtlMs: 1500 });
    const again = await rs.pools.acquire(name, { runId: run.id, key: 'k1', leaseTtlMs: 1500 });
    assert.equal(again.id, held.id);
    again.stopRenewing();
    setTimeout(() => void held.release(), 300);
    const waited = await rs.pools.acquire(name, { runId: run.id, waitMs: 20_000, leaseTtlMs: 1500 });
    assert.equal(waited.data.state, 'HELD');
    await run.cancel();
    await until(() => waited.signal.aborted, 'the lease signal to abort', 15_000);
    assert.equal(waited.lost, true);
    assert.equal(waited.lostReason, 'scope_refused');
    await assert.rejects(waited.renew(), ScopeCancelledError);
    assert.equal((await waited.release()).state, 'RELEASED'); // release works after cancel
  });
});
