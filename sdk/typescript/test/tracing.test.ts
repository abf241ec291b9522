/**
 * Tracing against the live service: with `@opentelemetry/api` and an in-memory tracer provider,
 * a submit or send is a `send` span, a claim or receive that hands out work a `receive` span
 * linked to the senders, and the worker loops run each handler in a `process` span, child of
 * the submitter's `send` span (the claim's `traceparent`), with a `settle` span under it; every
 * request carries the active span's context. With the API unresolvable (a copy of the package
 * where no `node_modules` can be found), submit, send, receive and `consume` work as before.
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

import { NotFoundError, Runstate, type TaskContext } from '../src/index.js';
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

/** The one span of `operation` among `spans`. */
function theOne(spans: ReadableSpan[], operation: string): ReadableSpan {
  const found = only(spans, operation);
  assert.equal(found.length, 1, `${operation}: ${JSON.stringify(spans.map((span) => span.name))}`);
  return found[0] as ReadableSpan;
}

/** The `traceparent` naming `span` (sampled). */
function traceparentOf(span: ReadableSpan): string {
  return `00-${span.spanContext().traceId}-${span.spanContext().spanId}-01`;
}

describe('tracing', { concurrency: true, timeout: 120_000 }, () => {
  test('tracing: a task submitted with a known traceparent is sent, processed and settled in its trace', async () => {
    const mailbox = unique('traced');
    const child = unique('traced-child');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    await rs.mailboxes.ensure(child, { mode: 'WORK' });
    const run = await rs.scopes.create();
    // The submitter's context is KNOWN, another process's span: a header it was configured with.
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

    await until(() => spansWhere('runstate.task_id', ticket.id).length >= 3, 'the send, process and settle spans');
    const spans = spansWhere('runstate.task_id', ticket.id);
    const sent = theOne(spans, 'send');
    const processed = theOne(spans, 'process');
    const settled = theOne(spans, 'settle');
    // The submit's send span is the child of KNOWN; the task stored its context.
    assert.equal(sent.name, `send ${mailbox}`);
    assert.equal(sent.kind, SpanKind.PRODUCER);
    assert.equal(sent.parentSpanContext?.spanId, SPAN_ID);
    assert.equal(sent.spanContext().traceId, TRACE_ID);
    assert.equal(processed.name, `process ${mailbox}`);
    assert.equal(processed.kind, SpanKind.CONSUMER);
    assert.equal(processed.spanContext().traceId, TRACE_ID);
    assert.equal(processed.parentSpanContext?.spanId, sent.spanContext().spanId);
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

    // The handler's submit is a send span under the process span; the child task's claim names it.
    const [claim] = await run.tasks.claim(child, { waitMs: 5_000 });
    assert.ok(claim);
    const childSent = theOne(spansWhere('runstate.task_id', claim.taskId), 'send');
    assert.equal(childSent.parentSpanContext?.spanId, processed.spanContext().spanId);
    assert.equal(claim.data.traceparent, traceparentOf(childSent));
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

    await until(() => spansWhere('runstate.task_id', ticket.id).length >= 5, 'a send, two process and two settle spans');
    const spans = spansWhere('runstate.task_id', ticket.id);
    const sent = theOne(spans, 'send');
    assert.equal(sent.parentSpanContext?.spanId, agent.spanId);
    const processed = only(spans, 'process').sort((a, b) => Number(a.attributes['runstate.attempt']) - Number(b.attributes['runstate.attempt']));
    assert.deepEqual(
      processed.map((span) => span.attributes['runstate.attempt']),
      [1, 2],
    );
    for (const span of processed) {
      assert.equal(span.spanContext().traceId, agent.traceId);
      assert.equal(span.parentSpanContext?.spanId, sent.spanContext().spanId);
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

    await until(() => spansWhere('runstate.message_id', message.id).length >= 3, 'the send, process and settle spans');
    const spans = spansWhere('runstate.message_id', message.id);
    const sent = theOne(spans, 'send');
    const processed = theOne(spans, 'process');
    const settled = theOne(spans, 'settle');
    assert.equal(sent.name, `send ${mailbox}`);
    assert.equal(sent.kind, SpanKind.PRODUCER);
    assert.equal(sent.parentSpanContext?.spanId, sender.spanId);
    assert.equal(processed.name, `process ${mailbox}`);
    assert.equal(processed.spanContext().traceId, sender.traceId);
    assert.equal(processed.parentSpanContext?.spanId, sent.spanContext().spanId);
    assert.equal(processed.attributes['runstate.attempt'], 1);
    assert.equal(processed.attributes['runstate.run_id'], run.id);
    assert.equal(settled.parentSpanContext?.spanId, processed.spanContext().spanId);
    assert.equal(settled.attributes['runstate.outcome'], 'completed');
  });

  test('tracing: a claim that hands out work is a receive span linked to the send spans; an empty one leaves none', async () => {
    const mailbox = unique('traced-receive');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const { one, two, agent } = await tracer.startActiveSpan('agent step', async (span) => {
      try {
        const first = await run.tasks.submit(mailbox, { n: 1 });
        const [second] = await run.tasks.submitMany(mailbox, [{ input: { n: 2 } }]);
        return { one: first, two: second, agent: span.spanContext() };
      } finally {
        span.end();
      }
    });
    assert.ok(two);
    const sent = theOne(spansWhere('runstate.task_id', one.id), 'send');
    assert.equal(sent.name, `send ${mailbox}`);
    assert.equal(sent.kind, SpanKind.PRODUCER);
    assert.equal(sent.parentSpanContext?.spanId, agent.spanId);
    assert.deepEqual(sent.attributes, {
      'messaging.system': 'runstate',
      'messaging.operation.type': 'send',
      'messaging.destination.name': mailbox,
      'runstate.run_id': run.id,
      'runstate.task_id': one.id,
    });
    // The batch submit is a send span of its own (no task id: it carries many).
    const batches = exporter
      .getFinishedSpans()
      .filter((span) => span.name === `send ${mailbox}` && span.attributes['runstate.task_id'] === undefined);
    assert.equal(batches.length, 1);
    const batch = batches[0] as ReadableSpan;
    assert.equal(batch.parentSpanContext?.spanId, agent.spanId);

    const claims = await run.tasks.claim(mailbox, { max: 2, waitMs: 5_000 });
    assert.deepEqual(claims.map((claim) => claim.taskId).sort(), [one.id, two.id].sort());
    for (const claim of claims) {
      assert.equal(claim.data.traceparent, traceparentOf(claim.taskId === one.id ? sent : batch));
      await claim.complete();
    }
    assert.deepEqual(await run.tasks.claim(mailbox, { waitMs: 0 }), []);
    const received = spansWhere('messaging.destination.name', mailbox).filter((span) => span.name === `receive ${mailbox}`);
    assert.equal(received.length, 1, 'the empty claim leaves no receive span');
    const receive = received[0] as ReadableSpan;
    assert.equal(receive.kind, SpanKind.CLIENT);
    assert.equal(receive.parentSpanContext, undefined); // claimed outside any span
    assert.deepEqual(receive.attributes, {
      'messaging.system': 'runstate',
      'messaging.operation.type': 'receive',
      'messaging.destination.name': mailbox,
      'runstate.run_id': run.id,
      'messaging.batch.message_count': 2,
    });
    assert.deepEqual(
      receive.links.map((link) => link.context.spanId).sort(),
      [sent.spanContext().spanId, batch.spanContext().spanId].sort(),
    );
  });

  test('tracing: a message receive links its sender, and a group member submit is a send span with the group', async () => {
    const queue = unique('traced-inbox');
    const work = unique('traced-group');
    const rs = new Runstate();
    await rs.mailboxes.ensure(queue, { mode: 'QUEUE' });
    await rs.mailboxes.ensure(work, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const message = await run.messages.send(queue, { n: 7 }); // no active span: a root send span
    const sent = theOne(spansWhere('runstate.message_id', message.id), 'send');
    assert.equal(sent.parentSpanContext, undefined);
    assert.equal(sent.attributes['runstate.run_id'], run.id);
    const [delivery] = await run.messages.receive(queue, { waitMs: 5_000 });
    assert.ok(delivery);
    assert.equal(delivery.data.traceparent, traceparentOf(sent));
    await delivery.complete();
    const receive = theOne(spansWhere('messaging.destination.name', queue), 'receive');
    assert.deepEqual(
      receive.links.map((link) => [link.context.traceId, link.context.spanId]),
      [[sent.spanContext().traceId, sent.spanContext().spanId]],
    );
    assert.equal(receive.attributes['messaging.batch.message_count'], 1);

    const group = await run.groups.create({ mailbox: work, condition: 'FIRST_ACCEPTED', parentScopeId: run.id });
    const member = await group.submit({ n: 8 });
    const memberSent = theOne(spansWhere('runstate.task_id', member.id), 'send');
    assert.equal(memberSent.name, `send ${work}`);
    assert.equal(memberSent.attributes['runstate.group_id'], group.id);
    assert.equal(memberSent.attributes['runstate.run_id'], group.data?.scopeId);
  });

  test('tracing: a refused submit ends its send span with the error', async () => {
    const run = await new Runstate().scopes.create();
    const missing = unique('no-such-mailbox');
    await assert.rejects(run.tasks.submit(missing, { n: 9 }), NotFoundError);
    const [sent] = exporter.getFinishedSpans().filter((span) => span.name === `send ${missing}`);
    assert.ok(sent);
    assert.equal(sent.status.code, SpanStatusCode.ERROR);
    assert.equal(sent.events[0]?.name, 'exception');
    assert.equal(sent.attributes['runstate.task_id'], undefined);
  });

  test('tracing: with @opentelemetry/api unresolvable, submit, send, receive and consume work and trace nothing', async () => {
    const mailbox = unique('untraced');
    const queue = unique('untraced-inbox');
    const rs = new Runstate();
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    await rs.mailboxes.ensure(queue, { mode: 'QUEUE' });
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
const [mailbox, queue, runId, known] = process.argv.slice(2);
let resolvable = true;
try { createRequire(import.meta.url)('@opentelemetry/api'); } catch { resolvable = false; }
// Without the API the configured header is what every request carries.
const run = new Runstate({ headers: { traceparent: known } }).scope(runId);
const own = await run.tasks.submit(mailbox, { n: 5 });
await run.messages.send(queue, { n: 6 });
const [delivery] = await run.messages.receive(queue, { waitMs: 5000 });
await delivery.complete();
const seen = [];
const worker = new Runstate().scope(runId).worker(mailbox, (work) => {
  seen.push([work.taskId, work.attempt]);
  if (seen.length === 2) worker.stop();
  return { traced: false };
}, { handleSignals: false });
const summary = await worker.run();
console.log(JSON.stringify({ resolvable, own: own.id, delivered: delivery.data.traceparent, seen, summary }));
`,
      );
      const env = { ...process.env };
      delete env['NODE_PATH'];
      const { stdout } = await promisify(execFile)(
        process.execPath,
        [join(folder, 'main.js'), mailbox, queue, run.id, KNOWN],
        { cwd: folder, env, timeout: 60_000 },
      );
      const answer = JSON.parse(stdout) as {
        resolvable: boolean;
        own: string;
        delivered: string;
        seen: [string, number][];
        summary: { completed: number; lost: number };
      };
      assert.equal(answer.resolvable, false);
      assert.equal(answer.delivered, KNOWN);
      assert.deepEqual(answer.seen.sort(), [[ticket.id, 1], [answer.own, 1]].sort());
      assert.deepEqual([answer.summary.completed, answer.summary.lost], [2, 0]);
      const own = await rs.tasks.get(answer.own).status();
      assert.equal(own.state, 'SUCCEEDED');
      assert.deepEqual(spansWhere('runstate.task_id', answer.own), []);
    } finally {
      await rm(folder, { recursive: true, force: true });
    }
    const task = await ticket.status();
    assert.equal(task.state, 'SUCCEEDED');
    assert.deepEqual(task.outcome, { traced: false });
    // In this process only its own submit's send span: the copy recorded nothing here.
    assert.deepEqual(
      spansWhere('runstate.task_id', ticket.id).map((span) => span.attributes['messaging.operation.type']),
      ['send'],
    );
  });
});
