/**
 * A consumer in a process of its own, for the kill and SIGTERM tests (not a test file).
 *
 *     node dist/test/consumer-process.js MAILBOX MODE [DRAIN_TIMEOUT_MS]
 *
 * Configured from RUNSTATE_URL / RUNSTATE_API_KEY / RUNSTATE_SCOPE_ID. Prints `claimed <task id>
 * <attempt>` when a handler starts and `summary ...` when `consume` resolves. MODE: `hang` (the
 * handler never returns, ignoring its signal) or `finish` (it returns after one second).
 */

import { Runstate } from '../src/index.js';

const [mailbox = '', mode = 'hang', drain = '30000'] = process.argv.slice(2);
const rs = new Runstate();
const summary = await rs.scope().consume(
  mailbox,
  async (context) => {
    console.log(`claimed ${context.taskId} ${context.attempt}`);
    await new Promise((resolve) => setTimeout(resolve, mode === 'hang' ? 3_600_000 : 1_000).unref());
    return { mode, stopReason: context.stopReason };
  },
  { concurrency: 1, drainTimeoutMs: Number(drain) },
);
const { completed, failed, lost, released, stopReason } = summary;
console.log(`summary completed=${completed} failed=${failed} lost=${lost} released=${released} stopReason=${stopReason}`);
