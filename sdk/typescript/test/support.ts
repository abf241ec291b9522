/** What the tests share: the live server's settings (from the pytest module) and small helpers. */

import assert from 'node:assert/strict';
import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { dirname, join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

const CONSUMER = join(dirname(fileURLToPath(import.meta.url)), 'consumer-process.js');

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

/**
 * Start `consumer-process.js` on `runId` (the task loop, or with `loop: 'messages'` the message
 * loop); its stdout lines arrive through `next()`.
 */
export function consumerProcess(
  runId: string,
  mailbox: string,
  mode: 'hang' | 'finish',
  options: { drainMs?: number; loop?: 'tasks' | 'messages' } = {},
) {
  const args = [CONSUMER, mailbox, mode, String(options.drainMs ?? 30_000), options.loop ?? 'tasks'];
  const child: ChildProcessWithoutNullStreams = spawn(process.execPath, args, {
    env: { ...process.env, RUNSTATE_SCOPE_ID: runId },
  });
  let stderr = '';
  child.stderr.on('data', (chunk: Buffer) => {
    stderr += chunk.toString();
  });
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  const next = async (timeoutMs = 20_000): Promise<string> => {
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new Error(`no output from the consumer process; stderr:\n${stderr}`)), timeoutMs);
    });
    try {
      const line = await Promise.race([lines.next(), timeout]);
      if (line.done) throw new Error(`the consumer process ended; stderr:\n${stderr}`);
      return line.value;
    } finally {
      clearTimeout(timer);
    }
  };
  return { child, next };
}
