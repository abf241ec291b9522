/** The client surface: configuration, handles, errors, retries, waits, events, batches and messages. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';

import {
  AuthenticationError,
  BudgetExhaustedError,
  ConflictError,
  LeaseLostError,
  NotFoundError,
  PoolExhaustedError,
  QuotaExhaustedError,
  RateLimitedError,
  Runstate,
  RunstateError,
  ScopeCancelledError,
  ServiceUnavailableError,
  TimeoutError,
  TransportError,
  ValidationError,
  type EventData,
} from '../src/index.js';
import { requiredEnv, unique } from './support.js';

interface Call {
  method: string;
  url: URL;
  headers: Headers;
  body: unknown;
}

/** A `fetch` that answers from `answer(call, index)` and records every call. */
function fakeFetch(answer: (call: Call, index: number) => Response | Promise<Response>) {
  const calls: Call[] = [];
  const fetch = (async (input: string | URL | Request, init?: RequestInit) => {
    const call: Call = {
      method: init?.method ?? 'GET',
      url: new URL(String(input)),
      headers: new Headers(init?.headers),
      body: typeof init?.body === 'string' ? JSON.parse(init.body) : undefined,
    };
    calls.push(call);
    return answer(call, calls.length - 1);
  }) as typeof globalThis.fetch;
  return { calls, fetch };
}

function json(status: number, body: unknown, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json', ...headers } });
}

function refusal(status: number, code: string, message = code): Response {
  return json(status, { error: { code, message, details: { field: 'x' } } });
}

const FAST = { url: 'http://runstate.invalid', apiKey: 'rs_test_key', backoffBaseMs: 1, backoffMaxMs: 2 };

describe('configuration and handles', () => {
  test('the client reads RUNSTATE_URL and RUNSTATE_API_KEY, and ignores a trailing /v1', async () => {
    const rs = new Runstate();
    assert.equal(rs.config.url, requiredEnv('RUNSTATE_URL').replace(/\/+$/, ''));
    assert.equal(rs.config.apiKey, requiredEnv('RUNSTATE_API_KEY'));
    assert.equal(new Runstate({ url: 'http://example.test:8000/v1/' }).config.url, 'http://example.test:8000');
    assert.deepEqual(await rs.health(), { ...(await rs.health()), status: 'ok' });
  });

  test('handles are built without a request', () => {
    const { calls, fetch } = fakeFetch(() => json(200, {}));
    const rs = new Runstate({ ...FAST, fetch });
    const run = rs.scope('run-1');
    assert.equal(run.id, 'run-1');
    assert.equal(run.groups.byId('g').id, 'g');
    assert.equal(run.barriers.get('b').id, 'b');
    assert.equal(run.timers.get('t').fireAt, null);
    assert.equal(rs.tasks.get('task').id, 'task');
    assert.equal(calls.length, 0);
  });

  test('rs.scope() takes RUNSTATE_SCOPE_ID, and says so when it is missing', () => {
    const rs = new Runstate(FAST);
    const saved = process.env['RUNSTATE_SCOPE_ID'];
    try {
      delete process.env['RUNSTATE_SCOPE_ID'];
      assert.throws(() => rs.scope(), /RUNSTATE_SCOPE_ID/);
      process.env['RUNSTATE_SCOPE_ID'] = 'from-env';
      assert.equal(rs.scope().id, 'from-env');
    } finally {
      if (saved === undefined) delete process.env['RUNSTATE_SCOPE_ID'];
      else process.env['RUNSTATE_SCOPE_ID'] = saved;
    }
  });
});

describe('errors and retries (a fake fetch)', () => {
  test('error answers map to the exported classes, 409s by code', async () => {
    const cases: [Response, new (...args: never[]) => RunstateError, string][] = [
      [refusal(400, 'VALIDATION_ERROR'), ValidationError, 'VALIDATION_ERROR'],
      [refusal(401, 'UNAUTHENTICATED'), AuthenticationError, 'UNAUTHENTICATED'],
      [refusal(404, 'NOT_FOUND'), NotFoundError, 'NOT_FOUND'],
      [refusal(409, 'SCOPE_CANCELLED'), ScopeCancelledError, 'SCOPE_CANCELLED'],
      [refusal(409, 'LEASE_LOST'), LeaseLostError, 'LEASE_LOST'],
      [refusal(409, 'POOL_EXHAUSTED'), PoolExhaustedError, 'POOL_EXHAUSTED'],
      [refusal(409, 'QUOTA_EXHAUSTED'), QuotaExhaustedError, 'QUOTA_EXHAUSTED'],
      [refusal(409, 'BUDGET_EXHAUSTED'), BudgetExhaustedError, 'BUDGET_EXHAUSTED'],
      [refusal(409, 'GROUP_CLOSED'), ConflictError, 'GROUP_CLOSED'],
      [new Response('<html>bad gateway</html>', { status: 418 }), RunstateError, 'HTTP_418'],
    ];
    for (const [response, Class, code] of cases) {
      const { fetch } = fakeFetch(() => response.clone());
      const error = await new Runstate({ ...FAST, fetch }).scopes.create().catch((caught: unknown) => caught);
      assert.ok(error instanceof Class, `${code}: ${String(error)}`);
      assert.ok(error instanceof RunstateError);
      assert.equal(error.code, code);
    }
    const { fetch } = fakeFetch(() => refusal(409, 'SCOPE_CANCELLED'));
    const error = await new Runstate({ ...FAST, fetch }).scope('r').child().catch((caught: unknown) => caught);
    assert.ok(error instanceof ConflictError && error.status === 409 && error.details['field'] === 'x');
  });

  test('idempotent calls are retried on 503 and network errors; others are sent once', async () => {
    const flaky = fakeFetch((_, index) => {
      if (index === 0) throw new TypeError('fetch failed');
      if (index === 1) return refusal(503, 'SERVICE_UNAVAILABLE');
      return json(200, { id: 'r', storedState: 'ACTIVE' });
    });
    assert.equal((await new Runstate({ ...FAST, fetch: flaky.fetch }).scope('r').status()).id, 'r');
    assert.equal(flaky.calls.length, 3);

    const create = fakeFetch(() => refusal(503, 'SERVICE_UNAVAILABLE'));
    await assert.rejects(new Runstate({ ...FAST, fetch: create.fetch }).scopes.create(), ServiceUnavailableError);
    assert.equal(create.calls.length, 1); // two creates would make two runs

    const claim = fakeFetch(() => {
      throw new TypeError('fetch failed');
    });
    await assert.rejects(new Runstate({ ...FAST, fetch: claim.fetch }).scope('r').tasks.claim('m'), TransportError);
    assert.equal(claim.calls.length, 1);

    const keyed = fakeFetch((_, index) => (index === 0 ? refusal(503, 'SERVICE_UNAVAILABLE') : json(201, { id: 't' })));
    await new Runstate({ ...FAST, fetch: keyed.fetch }).scope('r').tasks.submit('m', {}, { key: 'k' });
    assert.equal(keyed.calls.length, 2); // with a key the submit is idempotent

    const down = fakeFetch(() => refusal(503, 'SERVICE_UNAVAILABLE'));
    await assert.rejects(new Runstate({ ...FAST, fetch: down.fetch, maxRetries: 2 }).scope('r').status(), ServiceUnavailableError);
    assert.equal(down.calls.length, 3);
  });

  test('a 429 carries retryAfterMs', async () => {
    const { fetch } = fakeFetch(() => json(429, { error: { code: 'RATE_LIMITED', message: 'slow down' } }, { 'Retry-After': '2' }));
    const error = await new Runstate({ ...FAST, fetch, maxRetries: 0 }).scope('r').status().catch((caught: unknown) => caught);
    assert.ok(error instanceof RateLimitedError);
    assert.equal(error.retryAfterMs, 2000);
  });

  test("waits loop past the server's 30 s cap until the caller's timeoutMs", async () => {
    const { calls, fetch } = fakeFetch((_, index) => json(200, { id: 't', state: index < 2 ? 'RUNNING' : 'SUCCEEDED' }));
    const task = await new Runstate({ ...FAST, fetch }).tasks.get('t').result({ timeoutMs: 600_000 });
    assert.equal(task.state, 'SUCCEEDED');
    assert.deepEqual(
      calls.map((call) => call.url.searchParams.get('timeoutMs')),
      ['30000', '30000', '30000'],
    );
    assert.equal(calls[0]?.url.pathname, '/v1/tasks/t/result');
  });

  test('the SSE stream resumes from the last event with Last-Event-ID', async () => {
    const frame = (id: string): string => `id: ${id}\nevent: run.created\ndata: ${JSON.stringify({ id, type: 'run.created' })}\n\n`;
    const { calls, fetch } = fakeFetch((_, index) => {
      const encoder = new TextEncoder();
      const chunks = ['retry: 1000\n\n: heartbeat\n\n', ...(index === 0 ? [frame('e1'), frame('e2')] : [frame('e3')])];
      const body = new ReadableStream<Uint8Array>({
        pull(controller) {
          const chunk = chunks.shift();
          if (chunk !== undefined) controller.enqueue(encoder.encode(chunk));
          else if (index === 0) controller.error(new TypeError('connection reset')); // the first connection drops
          else return new Promise<void>(() => setTimeout(() => undefined, 60_000).unref()); // the second stays open
        },
      });
      return new Response(body, { status: 200, headers: { 'Content-Type': 'text/event-stream' } });
    });
    const seen: string[] = [];
    for await (const event of new Runstate({ ...FAST, fetch }).events.stream({ after: 'e0', runId: 'r' })) {
      seen.push(event.id);
      if (seen.length === 3) break;
    }
    assert.deepEqual(seen, ['e1', 'e2', 'e3']);
    assert.deepEqual(
      calls.map((call) => call.headers.get('Last-Event-ID')),
      ['e0', 'e2'],
    );
    assert.equal(calls[0]?.url.searchParams.get('runId'), 'r');
  });
});

describe('against the live service', { concurrency: true, timeout: 180_000 }, () => {
  test('errors from the service: not found, conflict codes, validation, authentication', async () => {
    const rs = new Runstate();
    await assert.rejects(rs.scope('01a2b3c4-0000-7000-8000-000000000000').status(), NotFoundError);
    const run = await rs.scopes.create();
    await run.cancel();
    const error = await run.complete().catch((caught: unknown) => caught);
    assert.ok(error instanceof ScopeCancelledError && error instanceof ConflictError);
    assert.equal(error.code, 'SCOPE_CANCELLED');
    await assert.rejects(rs.scopes.create({ deadline: new Date(Date.now() - 60_000) }), ValidationError);
    await assert.rejects(new Runstate({ apiKey: 'rs_nope_nope' }).scopes.create(), AuthenticationError);
  });

  test('a wait throws TimeoutError after timeoutMs', async () => {
    const rs = new Runstate();
    const mailbox = unique('idle');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const ticket = await run.tasks.submit(mailbox, { n: 1 });
    const error = await ticket.result({ timeoutMs: 300 }).catch((caught: unknown) => caught);
    assert.ok(error instanceof TimeoutError);
    assert.equal((error.last as { state: string }).state, 'QUEUED');
    const cancelled = await ticket.cancel({ reason: 'not needed' });
    assert.equal(cancelled.state, 'CANCELLED');
  });

  test('rerun submits a finished task again, idempotently by key', async () => {
    const rs = new Runstate();
    const mailbox = unique('rerun');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const ticket = await run.tasks.submit(mailbox, { n: 1 });
    const early = await ticket.rerun().catch((caught: unknown) => caught);
    assert.ok(early instanceof ConflictError);
    assert.equal(early.code, 'INVALID_STATE');
    await ticket.cancel();
    const again = await ticket.rerun();
    assert.notEqual(again.id, ticket.id);
    assert.equal(again.data?.rerunOf, ticket.id);
    assert.deepEqual(again.data?.input, { n: 1 });
    const fixed = await ticket.rerun({ key: 'fix', input: { n: 2 } });
    assert.deepEqual(fixed.data?.input, { n: 2 });
    assert.equal((await ticket.rerun({ key: 'fix', input: { n: 2 } })).id, fixed.id);
    await run.cancel();
    await assert.rejects(ticket.rerun(), ScopeCancelledError);
  });

  test('submitMany, claim, renewMany and completeMany', async () => {
    const rs = new Runstate();
    const mailbox = unique('batch');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const items = Array.from({ length: 5 }, (_, n) => ({ input: { n }, key: `k-${n}` }));
    const tickets = await run.tasks.submitMany(mailbox, items);
    assert.deepEqual(
      (await run.tasks.submitMany(mailbox, items)).map((ticket) => ticket.id),
      tickets.map((ticket) => ticket.id),
    ); // resubmitting the keyed list writes nothing new
    const claims = await run.tasks.claim(mailbox, { max: 5 });
    assert.equal(claims.length, 5);
    const renewed = await run.tasks.renewMany(claims, { leaseTtlMs: 60_000 });
    assert.ok(renewed.every((result) => result.ok && result.claim?.cancellationRequested === false));
    const [first, ...rest] = claims;
    assert.ok(first);
    await first.complete({ alone: true });
    const results = await rs.tasks.completeMany(claims.map((claim) => [claim, { n: (claim.task.input as { n: number }).n }] as const));
    assert.ok(results[0]?.error instanceof LeaseLostError); // already completed: per item, not thrown
    assert.ok(results.slice(1).every((result) => result.ok && result.task?.state === 'SUCCEEDED'));
    assert.equal(rest.length, 4);
  });

  test('queue messages: send, receive, complete, retry and reject', async () => {
    const rs = new Runstate();
    const mailbox = unique('queue');
    await rs.mailboxes.ensure(mailbox, { mode: 'QUEUE' });
    const run = await rs.scopes.create();
    for (const n of [1, 2, 3]) await run.messages.send(mailbox, { n }, { key: `m-${n}` });
    const deliveries = await run.messages.receive(mailbox, { max: 3, waitMs: 1_000 });
    assert.deepEqual(
      deliveries.map((delivery) => delivery.body),
      [{ n: 1 }, { n: 2 }, { n: 3 }],
    );
    const [one, two, three] = deliveries;
    assert.ok(one && two && three);
    assert.equal((await one.complete()).state, 'COMPLETED');
    await two.retry();
    assert.equal((await three.reject({ reason: 'malformed' })).state, 'DEAD_LETTERED');
    const again = await run.messages.receive(mailbox, { max: 3, waitMs: 1_000 });
    assert.deepEqual(
      again.map((delivery) => [delivery.body, delivery.attempt]),
      [[{ n: 2 }, 2]],
    );
  });

  test('queue messages: extend moves visibleUntil, a stale or cancelled delivery cannot extend', async () => {
    const rs = new Runstate();
    const mailbox = unique('extend');
    await rs.mailboxes.ensure(mailbox, { mode: 'QUEUE' });
    const run = await rs.scopes.create();
    await run.messages.send(mailbox, { n: 1 });
    const [delivery] = await run.messages.receive(mailbox, { visibilityMs: 1_000 });
    assert.ok(delivery);
    const before = delivery.visibleUntil?.getTime() ?? 0;
    const extended = await delivery.extend(60_000);
    assert.equal(extended.deliveryId, delivery.id);
    assert.ok((delivery.visibleUntil?.getTime() ?? 0) > before + 30_000);
    assert.deepEqual(await run.messages.receive(mailbox), []);
    await delivery.retry();
    await assert.rejects(delivery.extend(60_000), LeaseLostError);
    const [again] = await run.messages.receive(mailbox);
    assert.ok(again && again.attempt === 2);
    await run.cancel();
    await assert.rejects(again.extend(60_000), ScopeCancelledError);
  });

  test('groups: join a task, seal, and a finalized group refuses seal', async () => {
    const rs = new Runstate();
    const mailbox = unique('members');
    await rs.mailboxes.ensure(mailbox, { mode: 'WORK' });
    const run = await rs.scopes.create();
    const group = await run.groups.create({ mailbox, condition: 'FIRST_ACCEPTED', parentScopeId: run.id });
    const gate = rs.scope((await group.status()).scopeId);
    const loose = await gate.tasks.submit(mailbox, { loose: true });
    assert.equal((await group.joinTask(loose.id)).groupState, 'OPEN');
    const claims = await gate.tasks.claim(mailbox);
    await claims[0]?.complete('fine');
    const verdict = await rs.groups.byId(group.id).accept(loose.id);
    assert.deepEqual([verdict.groupState, verdict.outcome, verdict.outcomeReason], ['FINALIZED', 'SUCCESS', 'first_accepted']);
    await assert.rejects(group.seal(), (error: unknown) => error instanceof ConflictError && error.code === 'GROUP_FINALIZED');
    assert.equal((await group.close()).state, 'FINALIZED');
  });

  test('barriers re-arm with nextEpoch; timers re-attach with get and disarm with cancel', async () => {
    const rs = new Runstate();
    const run = await rs.scopes.create();
    const barrier = await run.barriers.create({ target: 1 });
    assert.equal((await barrier.arrive({ key: 'only' })).state, 'RELEASED');
    assert.equal((await barrier.wait()).state, 'RELEASED');
    const next = await barrier.nextEpoch();
    assert.deepEqual([next.epoch, next.state, next.arrivals], [2, 'WAITING', 0]);

    const timer = await run.timers.create({ at: new Date(Date.now() + 3_600_000) });
    const handle = rs.timers.get(timer.id);
    assert.equal(handle.fireAt, null);
    await handle.status();
    assert.equal((handle.fireAt as Date | null)?.getTime(), timer.fireAt.getTime());
    assert.equal((await handle.cancel()).state, 'CANCELLED');
    await assert.rejects(handle.wait({ timeoutMs: 1_000 }), (error: unknown) => error instanceof ConflictError);

    await run.cancel();
    await assert.rejects(run.barriers.create({ target: 2 }), ScopeCancelledError);
  });

  test('events: list with a cursor, follow, and the SSE stream (for await over rs.events)', async () => {
    const rs = new Runstate();
    const run = await rs.scopes.create();
    // A cursor reader sees an event once no older transaction can still commit before it (DESIGN.md
    // "Events"), which may be a moment later on a busy cluster: follow the log until it shows up.
    let created: EventData | undefined;
    for await (const event of rs.events.follow({ runId: run.id, signal: AbortSignal.timeout(60_000) })) {
      created = event;
      break;
    }
    assert.equal(created?.type, 'run.created');
    assert.equal(created?.runId, run.id);
    const start = { nextCursor: created?.id ?? '' };

    const controller = new AbortController();
    const streamed: EventData[] = [];
    const reading = (async () => {
      for await (const event of rs.events.stream({ runId: run.id, after: start.nextCursor, signal: controller.signal })) {
        streamed.push(event);
        if (event.type === 'run.cancelled') return;
      }
    })();
    const child = await run.child({ name: 'shard' });
    await run.cancel({ reason: 'done' });
    await reading;
    assert.deepEqual(
      streamed.map((event) => event.type),
      ['run.created', 'run.cancelled'],
    );
    assert.equal(streamed[0]?.runId, child.id);

    const followed: string[] = [];
    for await (const event of rs.events.follow({ runId: run.id, after: start.nextCursor })) {
      followed.push(event.id);
      if (followed.length === 2) break;
    }
    assert.deepEqual(
      followed,
      streamed.map((event) => event.id),
    );
    controller.abort();
  });
});
