/**
 * OpenTelemetry, optional: the spans of a piece of work, as the Python SDK makes them.
 *
 * `@opentelemetry/api` is an optional peer dependency, loaded once on first use with
 * `require` in a `try`: when it is not installed every function here is a no-op and nothing
 * throws. When it is, spans go to whatever tracer provider the application registered (none:
 * the API's no-op, and nothing is recorded).
 *
 * - A submit (one, a batch, a group member) or a message send is a `send <mailbox>` span
 *   (kind producer), child of the active span (or, with none, of a `traceparent` the client
 *   was configured with in `headers`), with the answer's `runstate.task_id` /
 *   `runstate.message_id`; the request carries its context, which the service stores on the
 *   task or message.
 * - A claim (or a receive) that hands out work is a `receive <mailbox>` span (kind client)
 *   linked to each item's sender, with `messaging.batch.message_count` (an empty long-poll
 *   leaves none).
 * - Every request carries the active span's W3C `traceparent` (and `tracestate`).
 * - A claim (or a delivery) answers the stored context; the worker loops run each handler in
 *   a `process <mailbox>` span (kind consumer), its child, with the handler's span current
 *   (its own spans and submits nest under it), and record the result in a
 *   `settle <mailbox>` span under it. A retry or takeover is a new `process` span with its
 *   `runstate.attempt`.
 *
 * Names and attributes are OpenTelemetry's messaging conventions, as `runstate/_tracing.py`:
 * `messaging.system=runstate`, `messaging.operation.type`, `messaging.destination.name` and
 * `runstate.run_id`, `runstate.task_id` (or `runstate.message_id`), `runstate.attempt`,
 * `runstate.group_id`.
 *
 * The types below are the few parts of the API used, written out so that the package's
 * declarations never name `@opentelemetry/api` (it type-checks without it).
 */

import { createRequire } from 'node:module';

type Attributes = Record<string, string | number>;

interface SpanContext {
  traceId: string;
  spanId: string;
  traceFlags: number;
  isRemote?: boolean;
  traceState?: { serialize(): string };
}

interface Span {
  spanContext(): SpanContext;
  setAttributes(attributes: Attributes): unknown;
  setStatus(status: { code: number; message?: string }): unknown;
  recordException(exception: unknown): void;
  isRecording(): boolean;
  end(): void;
}

interface Link {
  context: SpanContext;
}

interface SpanOptions {
  kind?: number;
  attributes?: Attributes;
  links?: Link[];
  startTime?: number;
}

interface Tracer {
  startSpan(name: string, options?: SpanOptions, context?: unknown): Span;
}

interface OtelApi {
  ROOT_CONTEXT: unknown;
  trace: {
    getTracer(name: string, version?: string): Tracer;
    getActiveSpan(): Span | undefined;
    setSpan(context: unknown, span: Span): unknown;
    setSpanContext(context: unknown, spanContext: SpanContext): unknown;
  };
  context: { active(): unknown; with<T>(context: unknown, fn: () => T): T };
  createTraceState?(raw?: string): { serialize(): string };
}

// The API's enums, by value (SpanKind, SpanStatusCode).
const SPAN_KIND_CLIENT = 2;
const SPAN_KIND_PRODUCER = 3;
const SPAN_KIND_CONSUMER = 4;
const STATUS_ERROR = 2;

export const MESSAGING_SYSTEM = 'runstate';
const TRACER_NAME = 'runstate';
const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

let loaded: OtelApi | null | undefined;

/** Return `@opentelemetry/api`, or `null` when it is not installed (looked up once). */
export function otelApi(): OtelApi | null {
  if (loaded === undefined) {
    try {
      loaded = createRequire(import.meta.url)('@opentelemetry/api') as OtelApi;
    } catch {
      loaded = null;
    }
  }
  return loaded;
}

/** Return whether `value` is a W3C `traceparent` a context can be taken from (as the service's check). */
export function validTraceparent(value: string | null | undefined): value is string {
  if (!value || value.length > 512) return false;
  const match = TRACEPARENT.exec(value);
  if (match === null) return false;
  const [, version, traceId, spanId, , rest] = match;
  if (version === 'ff' || traceId === '0'.repeat(32) || spanId === '0'.repeat(16)) return false;
  return !(version === '00' && rest);
}

/** Return the active span's `traceparent` (and `tracestate`) headers; nothing when there is none. */
export function traceHeaders(): Record<string, string> {
  const api = otelApi();
  const span = api?.trace.getActiveSpan();
  if (span === undefined) return {};
  const { traceId, spanId, traceFlags, traceState } = span.spanContext();
  const traceparent = `00-${traceId}-${spanId}-${(traceFlags & 0xff).toString(16).padStart(2, '0')}`;
  if (!validTraceparent(traceparent)) return {};
  const headers: Record<string, string> = { traceparent };
  const state = traceState?.serialize();
  if (state) headers['tracestate'] = state;
  return headers;
}

/** Return the remote span context `traceparent` names (`null` if it names none). */
function remoteSpanContext(
  api: OtelApi,
  traceparent: string | null | undefined,
  tracestate: string | null | undefined,
): SpanContext | null {
  if (!validTraceparent(traceparent)) return null;
  const [, traceId = '', spanId = '', flags = '00'] = traceparent.split('-');
  const remote: SpanContext = { traceId, spanId, traceFlags: parseInt(flags, 16), isRemote: true };
  if (tracestate && api.createTraceState) remote.traceState = api.createTraceState(tracestate);
  return remote;
}

/** Return the context whose span is the remote one `traceparent` names (the root context if it names none). */
function parentContext(api: OtelApi, traceparent: string | null | undefined, tracestate: string | null | undefined): unknown {
  const remote = remoteSpanContext(api, traceparent, tracestate);
  return remote === null ? api.ROOT_CONTEXT : api.trace.setSpanContext(api.ROOT_CONTEXT, remote);
}

/** Return the header `name` of `headers`, whatever its case. */
function header(headers: Readonly<Record<string, string>>, name: string): string | undefined {
  for (const [key, value] of Object.entries(headers)) {
    if (key.toLowerCase() === name) return value;
  }
  return undefined;
}

/**
 * Return the context a client's own span starts in: the active one when a span is active, else
 * the remote span of the `traceparent` the client was configured to send (`headers`), if any.
 */
function callerContext(api: OtelApi, headers: Readonly<Record<string, string>>): unknown {
  if (api.trace.getActiveSpan() !== undefined) return api.context.active();
  const traceparent = header(headers, 'traceparent');
  return traceparent === undefined ? api.context.active() : parentContext(api, traceparent, header(headers, 'tracestate'));
}

type Ids = Record<string, string | number | null | undefined>;

function runstateAttributes(runstate: Ids): Attributes {
  const out: Attributes = {};
  for (const [name, value] of Object.entries(runstate)) {
    if (value !== null && value !== undefined) out[`runstate.${name}`] = value;
  }
  return out;
}

function attributes(operation: string, mailbox: string, runstate: Ids): Attributes {
  return {
    'messaging.system': MESSAGING_SYSTEM,
    'messaging.operation.type': operation,
    'messaging.destination.name': mailbox,
    ...runstateAttributes(runstate),
  };
}

function describe(error: unknown): string {
  return error instanceof Error ? `${error.name}: ${error.message}` : String(error);
}

function failed(span: Span, error: unknown): void {
  span.recordException(error instanceof Error ? error : String(error));
  span.setStatus({ code: STATUS_ERROR, message: describe(error) });
}

/**
 * Run `call`, a submit or send to `mailbox`, in a `send <mailbox>` span (kind producer), child of
 * the caller's (`callerContext`): its requests carry the span's context, which the service
 * stores with the work. `ids(answer)` names what was submitted (`task_id`, `group_id`,
 * `message_id`). Without the API, or when nothing records the span, it is `call()`.
 */
export async function sendSpan<T>(
  headers: Readonly<Record<string, string>>,
  mailbox: string,
  runId: string | null | undefined,
  call: () => Promise<T>,
  ids?: (answer: T) => Ids,
): Promise<T> {
  const api = otelApi();
  if (api === null) return call();
  const span = api.trace
    .getTracer(TRACER_NAME)
    .startSpan(
      `send ${mailbox}`,
      { kind: SPAN_KIND_PRODUCER, attributes: attributes('send', mailbox, { run_id: runId }) },
      callerContext(api, headers),
    );
  if (!span.isRecording()) {
    span.end();
    return call();
  }
  try {
    const answer = await api.context.with(api.trace.setSpan(api.context.active(), span), call);
    if (ids !== undefined) span.setAttributes(runstateAttributes(ids(answer)));
    return answer;
  } catch (error) {
    failed(span, error);
    throw error;
  } finally {
    span.end();
  }
}

/** Return when a claim or receive call starts, for `recordReceive` (0 without the API). */
export function receiveStarted(): number {
  return otelApi() === null ? 0 : Date.now();
}

/**
 * Record the `receive <mailbox>` span (kind client) of a claim or receive call that started at
 * `startedMs` and handed out `items`, linked to each item's sender (its `traceparent`). A call
 * that handed out nothing (a long-poll that ran out) leaves no span.
 */
export function recordReceive(
  headers: Readonly<Record<string, string>>,
  mailbox: string,
  runId: string,
  startedMs: number,
  items: readonly { traceparent?: string | null | undefined; tracestate?: string | null | undefined }[],
): void {
  const api = otelApi();
  if (api === null || startedMs === 0 || items.length === 0) return;
  const links: Link[] = [];
  for (const item of items) {
    const sender = remoteSpanContext(api, item.traceparent, item.tracestate);
    if (sender !== null) links.push({ context: sender });
  }
  const spanAttributes = { ...attributes('receive', mailbox, { run_id: runId }), 'messaging.batch.message_count': items.length };
  api.trace
    .getTracer(TRACER_NAME)
    .startSpan(
      `receive ${mailbox}`,
      { kind: SPAN_KIND_CLIENT, attributes: spanAttributes, links, startTime: startedMs },
      callerContext(api, headers),
    )
    .end();
}

/** What a `process` span is started from: the claim's (or delivery's) context and ids. */
export interface ProcessSpanOptions {
  traceparent?: string | null | undefined;
  tracestate?: string | null | undefined;
  runId: string;
  taskId?: string;
  messageId?: string;
  attempt: number;
  groupId?: string | null;
}

/** The `process` span of one claimed task (or delivery): started at the claim, ended after its result. */
export class ProcessSpan {
  private ended = false;

  private constructor(
    private readonly api: OtelApi,
    private readonly span: Span,
    private readonly context: unknown,
    private readonly mailbox: string,
    private readonly spanAttributes: Attributes,
  ) {}

  /** Start the span, a child of the submitter's when the claim carries one; `null` when nothing records it. */
  static start(mailbox: string, options: ProcessSpanOptions): ProcessSpan | null {
    const api = otelApi();
    if (api === null) return null;
    const spanAttributes = attributes('process', mailbox, {
      run_id: options.runId,
      task_id: options.taskId,
      message_id: options.messageId,
      attempt: options.attempt,
      group_id: options.groupId,
    });
    const span = api.trace
      .getTracer(TRACER_NAME)
      .startSpan(
        `process ${mailbox}`,
        { kind: SPAN_KIND_CONSUMER, attributes: spanAttributes },
        parentContext(api, options.traceparent, options.tracestate),
      );
    if (!span.isRecording()) {
      span.end();
      return null;
    }
    return new ProcessSpan(api, span, api.trace.setSpan(api.ROOT_CONTEXT, span), mailbox, spanAttributes);
  }

  /** Run `fn` with this span current (what it starts, and the requests it sends, are its children). */
  run<T>(fn: () => T): T {
    return this.api.context.with(this.context, fn);
  }

  /** Record the handler's error on the span. */
  fail(error: unknown): void {
    failed(this.span, error);
  }

  /** Trace recording the result (`complete`, `fail`; for messages `completed`, `retried`, `rejected`) under this span. */
  async settle<T>(outcome: string, call: () => Promise<T>): Promise<T> {
    const settleAttributes = { ...this.spanAttributes, 'messaging.operation.type': 'settle', 'runstate.outcome': outcome };
    const span = this.api.trace
      .getTracer(TRACER_NAME)
      .startSpan(`settle ${this.mailbox}`, { kind: SPAN_KIND_CLIENT, attributes: settleAttributes }, this.context);
    try {
      return await this.api.context.with(this.api.trace.setSpan(this.context, span), call);
    } catch (error) {
      failed(span, error);
      throw error;
    } finally {
      span.end();
    }
  }

  /** End the span (once). */
  end(): void {
    if (this.ended) return;
    this.ended = true;
    this.span.end();
  }
}
