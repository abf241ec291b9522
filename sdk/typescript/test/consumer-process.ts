/**
 * A consumer in a process of its own, for the kill and SIGTERM tests (not a test file).
 *
 *     node dist/test/consumer-process.js MAILBOX MODE [DRAIN_TIMEOUT_MS] [tasks|messages]
 *
 * Configured from RUNSTATE_URL / RUNSTATE_API_KEY / RUNSTATE_SCOPE_ID. Runs the task loop
 * (`consume`, the default) or the message loop (`consumeMessages`). Prints `claimed <task id>
 * <attempt>` (or `received <message id> <attempt>`) when a handler starts and `summary ...` when
 * the loop resolves. MODE: `hang` (the handler never returns, ignoring its signal) or `finish`
 * (it returns after one second).
 */

import { Runstate, type HandlerContext } from '../src/index.js';

const [mailbox = '', mode = 'hang', drain = '30000', loop = 'tasks'] = process.argv.slice(2);
const options = { concurrency: 1, drainTimeoutMs: Number(drain) };
const rs = new Runstate();

async function work(started: string, context: HandlerContext): Promise<unknown> {
  console.log(started);
  await new Promise((resolve) => setTimeout(resolve, mode === 'hang' ? 3_600_000 : 1_000).unref());
  return { mode, stopReason: context.stopReason };
}

if (loop === 'messages') {
  const summary = await rs
    .scope()
    .consumeMessages(mailbox, (context) => work(`received ${context.messageId} ${context.attempt}`, context), options);
  const { completed, retried, rejected, deadLettered, lost, released, stopReason } = summary;
  console.log(
    `summary completed=${completed} retried=${retried} rejected=${rejected} deadLettered=${deadLettered} ` +
      `lost=${lost} released=${released} stopReason=${stopReason}`,
  );
} else {
  const summary = await rs.scope().consume(mailbox, (context) => work(`claimed ${context.taskId} ${context.attempt}`, context), options);
  const { completed, failed, lost, released, stopReason } = summary;
  console.log(`summary completed=${completed} failed=${failed} lost=${lost} released=${released} stopReason=${stopReason}`);
}
