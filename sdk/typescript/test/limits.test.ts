/** Quotas and budgets against the live server: take, put, create, reserve/commit/release. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import {
  BudgetExhaustedError,
  ConflictError,
  LimitExhaustedError,
  QuotaExhaustedError,
  Runstate,
  ScopeCancelledError,
  ValidationError,
} from '../src/index.js';
import { unique } from './support.js';

describe('quotas', () => {
  test('put fills the bucket, takes spend it, a refusal says when to retry', async () => {
    const rs = new Runstate();
    const run = await rs.scopes.create();
    const name = unique('llm');
    const created = await rs.quotas.put(name, { limit: 2, periodMs: 3_600_000 });
    assert.equal(created.available, 2);
    assert.deepEqual(await rs.quotas.take(name, { runId: run.id }), { granted: true, remaining: 1 });
    assert.equal((await rs.quotas.take(name, { runId: run.id, amount: 1 })).remaining, 0);
    await assert.rejects(rs.quotas.take(name, { runId: run.id, waitMs: 500 }), (error: unknown) => {
      assert.ok(error instanceof QuotaExhaustedError && error instanceof LimitExhaustedError);
      assert.equal(error.code, 'QUOTA_EXHAUSTED');
      assert.ok(Number(error.details['retryAfterMs']) > 500);
      return true;
    });
    await assert.rejects(rs.quotas.take(name, { runId: run.id, amount: 3 }), ValidationError);
    assert.equal((await rs.quotas.get(name)).available, 0);
  });

  test('a waiting take is granted once the bucket refills', async () => {
    const rs = new Runstate();
    const run = await rs.scopes.create();
    const name = unique('fast');
    await rs.quotas.put(name, { limit: 10, periodMs: 500 });
    await rs.quotas.take(name, { runId: run.id, amount: 10 });
    assert.equal((await rs.quotas.take(name, { runId: run.id, amount: 3, waitMs: 5000 })).granted, true);
  });
});

describe('budgets', () => {
  test('reservations count on every budget of the chain and settle as reported', async () => {
    const rs = new Runstate();
    const run = await rs.scopes.create();
    const child = await run.child();
    const budget = await run.budgets.create('usd', 1000);
    assert.equal(budget.data?.remaining, 1000);
    const spent = await rs.budgets.reserve('usd', { runId: child.id, amount: 300 }).use(async (reservation) => {
      assert.equal((await budget.status()).reserved, 300);
      reservation.spend(120);
      return reservation;
    });
    assert.equal(spent.data?.state, 'COMMITTED');
    assert.equal(spent.data?.committed, 120);
    const unused = await child.budgets.reserve('usd', { amount: 50 }).use(() => null);
    assert.equal(unused, null);
    const status = await budget.status();
    assert.deepEqual([status.spent, status.reserved, status.remaining], [120, 0, 880]);

    await assert.rejects(rs.budgets.reserve('usd', { runId: child.id, amount: 5000 }).open(), (error: unknown) => {
      assert.ok(error instanceof BudgetExhaustedError && error instanceof ConflictError);
      assert.equal(error.code, 'BUDGET_EXHAUSTED');
      assert.deepEqual(error.details, { remaining: 880, budgetId: budget.id, runId: run.id });
      return true;
    });
    assert.equal((await budget.setLimit(5120)).remaining, 5000);
    await assert.rejects(budget.setLimit(119), ValidationError);
    assert.equal((await budget.status()).limit, 5120);
    const kept = await rs.budgets.reserve('usd', { runId: child.id, amount: 10, key: 'k' }).open();
    const again = await rs.budgets.reserve('usd', { runId: child.id, amount: 10, key: 'k' }).open();
    assert.equal(kept.id, again.id);
    await run.cancel();
    await assert.rejects(rs.budgets.reserve('usd', { runId: child.id, amount: 1 }).open(), ScopeCancelledError);
    assert.equal((await kept.commit(4)).state, 'COMMITTED'); // allowed under the cancelled run
    assert.equal((await kept.release()).state, 'COMMITTED'); // idempotent: answered unchanged
    assert.equal((await rs.budgets.get(budget.id).status()).spent, 124);
  });
});
