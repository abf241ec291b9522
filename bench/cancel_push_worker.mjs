// A TypeScript worker process of bench/cancel_push.py: consume a run with handlers that wait for
// their signal; print `start <task>` and `trip <task> <time s> <reason> <push|renewal>` lines.
// Usage: node bench/cancel_push_worker.mjs URL KEY RUN_ID CONCURRENCY MAILBOX
// (the SDK built in sdk/typescript: npm ci && npm run build).

import { Runstate } from '../sdk/typescript/dist/src/index.js';
import { Worker } from '../sdk/typescript/dist/src/worker.js';

const [url, apiKey, runId, concurrency, mailbox] = process.argv.slice(2);

// Which channel told each claim: the watch, a renewal, else the claim loop (a run's refusal
// answered to its next claim call, which stops every handler of the loop at once).
const pushed = new Set();
const renewed = new Set();
const originalPushed = Worker.prototype.pushed;
Worker.prototype.pushed = function (type, claimId, data) {
  pushed.add(claimId);
  return originalPushed.call(this, type, claimId, data);
};
const originalRenewAll = Worker.prototype.renewAll;
Worker.prototype.renewAll = async function () {
  const quiet = [...this.held.values()].filter((held) => !held.context.signal.aborted);
  await originalRenewAll.call(this);
  for (const held of quiet) {
    if (held.context.signal.aborted && !pushed.has(held.claim.id)) renewed.add(held.claim.id);
  }
};

const rs = new Runstate({ url, apiKey });
await rs.scope(runId).consume(
  mailbox,
  async (context) => {
    process.stdout.write(`start ${context.taskId}\n`);
    await new Promise((resolve) => context.signal.addEventListener('abort', resolve, { once: true }));
    const source = pushed.has(context.claimId) ? 'push' : renewed.has(context.claimId) ? 'renewal' : 'refusal';
    process.stdout.write(`trip ${context.taskId} ${(Date.now() / 1000).toFixed(6)} ${context.stopReason} ${source}\n`);
  },
  { concurrency: Number(concurrency), handleSignals: true, drainTimeoutMs: 500 },
);
