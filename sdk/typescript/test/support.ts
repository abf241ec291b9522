/** What the tests share: the live server's settings (from the pytest module) and small helpers. */

import assert from 'node:assert/strict';

/** Read a variable the test command sets; fail clearly when the suite is run without it. */
export function requiredEnv(name: string): string {
  const value = process.env[name];
  assert.ok(value, `${name} is not set: run these tests through tests/sdk/test_typescript.py (scripts/test).`);
  return value;
}

/** A name unique to this test process and call (mailboxes are per project, and the files run at once). */
export function unique(prefix: string): string {
  return `${prefix}-${process.pid}-${Math.random().toString(36).slice(2, 8)}`;
}

/** Wait until `predicate()` holds, polling every 10 ms; fail after `timeoutMs`. */
export async function until(predicate: () => boolean, what: string, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!predicate()) {
    if (Date.now() > deadline) assert.fail(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}
