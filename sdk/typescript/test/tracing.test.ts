/**
 * Tracing against the live service: with `@opentelemetry/api` and an in-memory tracer provider,
 * the worker loops run each handler in a `process` span, child of the submitter's span (the
 * claim's `traceparent`), with a `settle` span under it; every request carries the active
 * span's context. With the API unresolvable (a copy of the package where no `node_modules` can
 * be found), `consume` works as before.
 */

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { cp, mkdtemp, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { describe, test } from 'node:test';

import { SpanKind, SpanStatusCode, context, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import {
  BasicTracerProvider,
  InMemorySpanExporter,
  SimpleSpanProcessor,
  type ReadableSpan,
} from '@opentelemetry/sdk-trace-base';

import { Runstate, type TaskContext } from '../src/index.js';
import { unique, until } from './support.js';

// This file runs in a process of its own (node --test): the provider is this process's.
const exporter = new InMemorySpanExporter();
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
const tracer = trace.getTracer('tracing-test');

const TRACE_ID = '4bf92f3577b34da6a3ce929d0e0e4736';
const SPAN_ID = '00f067aa0ba902b7';
const KNOWN = `00-${TRACE_ID}-${SPAN_ID}-01`;

function spansWhere(name: string, value: string): ReadableSpan[] {
  return exporter.getFinishedSpans().filter((span) => span.attributes[name] === value);
}

function only(spans: ReadableSpan[], operation: string): ReadableSpan[] {
  return spans.filter((span) => span.attributes['messaging.operation.type'] === operation);
}

describe('tracing', { concurrency: true, timeout: 120_000 }, () => {
  test('tracing: a task submitted with a known traceparent is processed in a child span of it, settled under it', async () => {
    const mailbox = unique('traced');
    const child = unique('traced-child');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    await rs.mailboxes.ensure(child, { mode: 'WORK' });
    const run = await rs.scopes.create();
    // The submitter is another process whose span is KNOWN: its header, no local span.
    const submitter = new Runstate({ headers: { traceparent: KNOWN, tracestate: 'vendor=1' } });
    const ticket = await submitter.scope(run.id).tasks.submit(mailbox, { n: 1 });

    let active: string | undefined;
    const worker = rs.scope(run.id).worker(
      mailbox,
      async (work: TaskContext) => {
        active = trace.getActiveSpan()?.spanContext().spanId;
        await run.tasks.submit(child, { from: work.taskId }); // carries the process span's context
        worker.stop();
        return { ok: true };
      },
      { handleSignals: false },
    );
    const summary = await worker.run();
    assert.equal(summary.completed, 1);
    assert.equal((await ticket.status()).state, 'SUCCEEDED');

    await until(() => spansWhere('runstate.task_id', ticket.id).length >= 2, 'the process and settle spans');
    const spans = spansWhere('runstate.task_id', ticket.id);
    const [processed] = only(spans, 'process');
    const [settled] = only(spans, 'settle');
    assert.ok(processed && settled, JSON.stringify(spans.map((span) => span.name)));
    assert.equal(processed.name, `process ${mailbox}`);
    assert.equal(processed.kind, SpanKind.CONSUMER);
    assert.equal(processed.spanContext().traceId, TRACE_ID);
    assert.equal(processed.parentSpanContext?.spanId, SPAN_ID);
    assert.equal(processed.parentSpanContext?.traceId, TRACE_ID);
    assert.equal(processed.parentSpanContext?.traceState?.get('vendor'), '1');
    assert.deepEqual(processed.attributes, {
      'messaging.system': 'runstate',
      'messaging.operation.type': 'process',
      'messaging.destination.name': mailbox,
      'runstate.run_id': run.id,
      'runstate.task_id': ticket.id,
      'runstate.attempt': 1,
    });
    assert.equal(active, processed.spanContext().spanId); // the handler ran with it current

    assert.equal(settled.name, `settle ${mailbox}`);
    assert.equal(settled.kind, SpanKind.CLIENT);
    assert.equal(settled.spanContext().traceId, TRACE_ID);
    assert.equal(settled.parentSpanContext?.spanId, processed.spanContext().spanId);
    assert.equal(settled.attributes['runstate.outcome'], 'complete');
    assert.equal(settled.attributes['messaging.operation.type'], 'settle');

    // The handler's submit carried its span: the child task's claim names the process span.
    const [claim] = await run.tasks.claim(child, { waitMs: 5_000 });
    assert.ok(claim);
    assert.equal(claim.data.traceparent, `00-${TRACE_ID}-${processed.spanContext().spanId}-01`);
    await claim.complete();
  });

  test('tracing: a submit inside a span carries it, and a failed attempt and its retry are two process spans in its trace', async () => {
    const mailbox = unique('traced-retry');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK', maxAttempts: 2 });
    const run = await rs.scopes.create();
    const { ticket, agent } = await tracer.startActiveSpan('agent step', async (span) => {
      try {
        return { ticket: await run.tasks.submit(mailbox, { n: 2 }), agent: span.spanContext() };
      } finally {
        span.end();
      }
    });

    const worker = rs.scope(run.id).worker(
      mailbox,
      (work: TaskContext) => {
        if (work.attempt === 1) throw new Error('first attempt fails');
        worker.stop();
        return 'second';
      },
      { handleSignals: false },
    );
    const summary = await worker.run();
    assert.deepEqual([summary.failed, summary.completed], [1, 1]);
    assert.equal((await ticket.status()).state, 'SUCCEEDED');

    await until(() => spansWhere('runstate.task_id', ticket.id).length >= 4, 'two process and two settle spans');
    const spans = spansWhere('runstate.task_id', ticket.id);
    const processed = only(spans, 'process').sort((a, b) => Number(a.attributes['runstate.attempt']) - Number(b.attributes['runstate.attempt']));
    assert.deepEqual(
      processed.map((span) => span.attributes['runstate.attempt']),
      [1, 2],
    );
    for (const span of processed) {
      assert.equal(span.spanContext().traceId, agent.traceId);
      assert.equal(span.parentSpanContext?.spanId, agent.spanId);
    }
    assert.equal(processed[0]?.status.code, SpanStatusCode.ERROR);
    assert.equal(processed[0]?.events[0]?.name, 'exception');
    assert.notEqual(processed[1]?.status.code, SpanStatusCode.ERROR);
    const outcomes = only(spans, 'settle').map((span) => [
      span.attributes['runstate.outcome'],
      processed.findIndex((parent) => parent.spanContext().spanId === span.parentSpanContext?.spanId),
    ]);
    assert.deepEqual(outcomes.sort(), [
      ['complete', 1],
      ['fail', 0],
    ]);
  });

  test("tracing: consumeMessages processes a message in a child span of the sender's", async () => {
    const mailbox = unique('traced-queue');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'QUEUE' });
    const run = await rs.scopes.create();
    const { message, sender } = await tracer.startActiveSpan('producer step', async (span) => {
      try {
        return { message: await run.messages.send(mailbox, { n: 3 }), sender: span.spanContext() };
      } finally {
        span.end();
      }
    });
    const worker = rs.scope(run.id).messageWorker(
      mailbox,
      () => {
        worker.stop();
      },
      { handleSignals: false },
    );
    assert.equal((await worker.run()).completed, 1);

    await until(() => spansWhere('runstate.message_id', message.id).length >= 2, 'the process and settle spans');
    const spans = spansWhere('runstate.message_id', message.id);
    const [processed] = only(spans, 'process');
    const [settled] = only(spans, 'settle');
    assert.ok(processed && settled);
    assert.equal(processed.name, `process ${mailbox}`);
    assert.equal(processed.spanContext().traceId, sender.traceId);
    assert.equal(processed.parentSpanContext?.spanId, sender.spanId);
    assert.equal(processed.attributes['runstate.attempt'], 1);
    assert.equal(processed.attributes['runstate.run_id'], run.id);
    assert.equal(settled.parentSpanContext?.spanId, processed.spanContext().spanId);
    assert.equal(settled.attributes['runstate.outcome'], 'completed');
  });

  test('tracing: with @opentelemetry/api unresolvable, consume works and traces nothing', async () => {
    const mailbox = unique('untraced');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const ticket = await new Runstate({ headers: { traceparent: KNOWN } }).scope(run.id).tasks.submit(mailbox, { n: 4 });

    // A copy of the compiled package in a folder from which no node_modules can be reached.
    const folder = await mkdtemp(join(tmpdir(), 'runstate-no-otel-'));
    try {
      await cp(join(dirname(fileURLToPath(import.meta.url)), '..', 'src'), join(folder, 'src'), { recursive: true });
      await writeFile(join(folder, 'package.json'), '{"type": "module"}\n');
      await writeFile(
        join(folder, 'main.js'),
        `import { createRequire } from 'node:module';
import { Runstate } from './src/index.js';
let resolvable = true;
try { createRequire(import.meta.url)('@opentelemetry/api'); } catch { resolvable = false; }
const seen = [];
const worker = new Runstate().scope(process.argv[3]).worker(process.argv[2], (work) => {
  seen.push([work.taskId, work.attempt]);
  worker.stop();
  return { traced: false };
}, { handleSignals: false });
const summary = await worker.run();
console.log(JSON.stringify({ resolvable, seen, summary }));
`,
      );
      const env = { ...process.env };
      delete env['NODE_PATH'];
      const { stdout } = await promisify(execFile)(process.execPath, [join(folder, 'main.js'), mailbox, run.id], {
        cwd: folder,
        env,
        timeout: 60_000,
      });
      const answer = JSON.parse(stdout) as { resolvable: boolean; seen: unknown; summary: { completed: number; lost: number } };
      assert.equal(answer.resolvable, false);
      assert.deepEqual(answer.seen, [[ticket.id, 1]]);
      assert.deepEqual([answer.summary.completed, answer.summary.lost], [1, 0]);
    } finally {
      await rm(folder, { recursive: true, force: true });
    }
    const task = await ticket.status();
    assert.equal(task.state, 'SUCCEEDED');
    assert.deepEqual(task.outcome, { traced: false });
    assert.deepEqual(spansWhere('runstate.task_id', ticket.id), []); // nothing in this process either
  });
});
