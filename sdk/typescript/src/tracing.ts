/**
 * OpenTelemetry, optional: the spans of a piece of work, as the Python SDK makes them.
 *
 * `@opentelemetry/api` is an optional peer dependency, loaded once on first use with
 * `require` in a `try`: when it is not installed every function here is a no-op and nothing
 * throws. When it is, spans go to whatever tracer provider the application registered (none:
 * the API's no-op, and nothing is recorded).
 *
 * - Every request carries the active span's W3C `traceparent` (and `tracestate`), so a
 *   submit (one, a batch, a group member) or a message send stores the caller's context on
 *   the task or message.
 * - A claim (or a delivery) answers that context; the worker loops run each handler in a
 *   `process <mailbox>` span (kind consumer), its child, with the handler's span current
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
  setStatus(status: { code: number; message?: string }): unknown;
  recordException(exception: unknown): void;
  isRecording(): boolean;
  end(): void;
}

interface Tracer {
  startSpan(name: string, options?: { kind?: number; attributes?: Attributes }, context?: unknown): Span;
}

interface OtelApi {
  ROOT_CONTEXT: unknown;
  trace: {
    getTracer(name: string, version?: string): Tracer;
    getActiveSpan(): Span | undefined;
    setSpan(context: unknown, span: Span): unknown;
    setSpanContext(context: unknown, spanContext: SpanContext): unknown;
  };
  context: { with<T>(context: unknown, fn: () => T): T };
  createTraceState?(raw?: string): { serialize(): string };
}

// The API's enums, by value (SpanKind, SpanStatusCode).
const SPAN_KIND_CLIENT = 2;
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

/** Return the context whose span is the remote one `traceparent` names (the root context if it names none). */
function parentContext(api: OtelApi, traceparent: string | null | undefined, tracestate: string | null | undefined): unknown {
  if (!validTraceparent(traceparent)) return api.ROOT_CONTEXT;
  const [, traceId = '', spanId = '', flags = '00'] = traceparent.split('-');
  const remote: SpanContext = { traceId, spanId, traceFlags: parseInt(flags, 16), isRemote: true };
  if (tracestate && api.createTraceState) remote.traceState = api.createTraceState(tracestate);
  return api.trace.setSpanContext(api.ROOT_CONTEXT, remote);
}

function attributes(operation: string, mailbox: string, runstate: Record<string, string | number | null | undefined>): Attributes {
  const out: Attributes = {
    'messaging.system': MESSAGING_SYSTEM,
    'messaging.operation.type': operation,
    'messaging.destination.name': mailbox,
  };
  for (const [name, value] of Object.entries(runstate)) {
    if (value !== null && value !== undefined) out[`runstate.${name}`] = value;
  }
  return out;
}

function describe(error: unknown): string {
  return error instanceof Error ? `${error.name}: ${error.message}` : String(error);
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
    this.span.recordException(error instanceof Error ? error : String(error));
    this.span.setStatus({ code: STATUS_ERROR, message: describe(error) });
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
      span.recordException(error instanceof Error ? error : String(error));
      span.setStatus({ code: STATUS_ERROR, message: describe(error) });
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
