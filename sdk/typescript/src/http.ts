/**
 * HTTP plumbing: configuration, timeouts, retries of idempotent calls, error mapping, waits
 * over the server's capped long-polls, and the Server-Sent Events reader.
 *
 * Whether a call may be retried is decided by each caller and passed as `idempotent`: a retry
 * must never repeat an effect. Reads, ensures and state transitions that answer the same on
 * repetition retry on network errors and 429/502/503/504; creates, claims, receives and
 * submits or sends without an idempotency key never do.
 *
 * Every call carries the active OpenTelemetry span's `traceparent` (`tracing.ts`), when there
 * is one.
 */

import { RunstateError, TimeoutError, TransportError, errorFromResponse, retryAfterMs } from './errors.js';
import { traceHeaders } from './tracing.js';

export const SDK_VERSION = '0.1.0';
export const DEFAULT_URL = 'http://127.0.0.1:8000';
/** The server caps every long-poll at 30 s (DESIGN.md "HTTP API"); waits loop over it. */
export const MAX_SERVER_WAIT_MS = 30_000;
const RETRYABLE_STATUS = new Set([429, 502, 503, 504]);

export interface RunstateOptions {
  /** The service, without `/v1` (a trailing `/v1` is ignored). Default `RUNSTATE_URL`, else `http://127.0.0.1:8000`. */
  url?: string;
  /** Sent as `Authorization: Bearer <key>`. Default `RUNSTATE_API_KEY`. */
  apiKey?: string;
  /** Bound on an ordinary request (a long-poll gets its wait on top). Default 30 000. */
  timeoutMs?: number;
  /** Retries of idempotent calls. Default 3. */
  maxRetries?: number;
  /** Exponential backoff with full jitter from `backoffBaseMs` (200) up to `backoffMaxMs` (10 000). */
  backoffBaseMs?: number;
  backoffMaxMs?: number;
  /** Extra headers sent with every request. */
  headers?: Record<string, string>;
  /** The `fetch` to use (default the global one of Node >= 20). */
  fetch?: typeof fetch;
}

export interface ClientConfig {
  readonly url: string;
  readonly apiKey: string | null;
  readonly timeoutMs: number;
  readonly maxRetries: number;
  readonly backoffBaseMs: number;
  readonly backoffMaxMs: number;
  readonly headers: Readonly<Record<string, string>>;
}

/** Fill what the options leave out from `RUNSTATE_URL` and `RUNSTATE_API_KEY`. */
export function buildConfig(options: RunstateOptions): ClientConfig {
  let url = (options.url ?? process.env['RUNSTATE_URL'] ?? '') || DEFAULT_URL;
  url = url.replace(/\/+$/, '');
  if (url.endsWith('/v1')) url = url.slice(0, -'/v1'.length);
  const maxRetries = options.maxRetries ?? 3;
  if (!Number.isInteger(maxRetries) || maxRetries < 0) throw new RangeError('maxRetries must be an integer >= 0');
  return {
    url,
    apiKey: (options.apiKey ?? process.env['RUNSTATE_API_KEY'] ?? '') || null,
    timeoutMs: options.timeoutMs ?? 30_000,
    maxRetries,
    backoffBaseMs: options.backoffBaseMs ?? 200,
    backoffMaxMs: options.backoffMaxMs ?? 10_000,
    headers: { ...(options.headers ?? {}) },
  };
}

export type Query = Record<string, string | number | undefined>;

export interface RequestOptions {
  /** Whether repeating the call cannot repeat an effect (then it is retried). */
  idempotent: boolean;
  body?: unknown;
  query?: Query;
  /** How long the server may hold the answer (a long-poll): added to the request timeout. */
  waitMs?: number;
  /** Aborts the request (and its retries) when it fires. */
  signal?: AbortSignal | undefined;
}

export interface WaitOptions<T> {
  done: (answer: T) => boolean;
  /** `null`: no limit. */
  timeoutMs: number | null;
  what: string;
  method?: 'GET' | 'POST';
}

/** Quote one path segment (an id or a mailbox name). */
export function segment(value: string): string {
  return encodeURIComponent(value);
}

/** Return the fields that are not `undefined` (an omitted field takes the server's default). */
export function compact<T extends Record<string, unknown>>(fields: T): Partial<T> {
  const out: Partial<T> = {};
  for (const [name, value] of Object.entries(fields)) {
    if (value !== undefined && value !== null) (out as Record<string, unknown>)[name] = value;
  }
  return out;
}

/** Return a time as RFC 3339 text (`Date` or a string passed through). */
export function wireTime(value: Date | string | undefined | null): string | undefined {
  if (value === undefined || value === null) return undefined;
  return typeof value === 'string' ? value : value.toISOString();
}

/** Parse an RFC 3339 time of an answer (`null` stays `null`). */
export function parseTime(value: unknown): Date | null {
  if (typeof value !== 'string' || value === '') return null;
  return new Date(value);
}

/** Resolve after `ms`, or reject with the signal's reason when it aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

function describe(error: unknown): string {
  if (error instanceof Error) {
    const cause = error.cause instanceof Error ? `: ${error.cause.message}` : '';
    return `${error.name}: ${error.message}${cause}`;
  }
  return String(error);
}

/** Send requests to `{url}/v1` and turn error answers into errors. */
export class Http {
  readonly config: ClientConfig;
  private readonly fetchImpl: typeof fetch;

  constructor(config: ClientConfig, fetchImpl?: typeof fetch) {
    this.config = config;
    this.fetchImpl = fetchImpl ?? globalThis.fetch;
    if (typeof this.fetchImpl !== 'function') {
      throw new Error('@runstate/client needs Node >= 20 (a global fetch) or the fetch option.');
    }
  }

  /** Return the headers sent with every request. */
  headers(extra: Record<string, string> = {}): Record<string, string> {
    const headers: Record<string, string> = {
      'User-Agent': `runstate-typescript/${SDK_VERSION}`,
      Accept: 'application/json',
    };
    if (this.config.apiKey) headers['Authorization'] = `Bearer ${this.config.apiKey}`;
    return { ...headers, ...this.config.headers, ...extra };
  }

  url(path: string, query?: Query): string {
    const url = new URL(`${this.config.url}/v1${path}`);
    for (const [name, value] of Object.entries(query ?? {})) {
      if (value !== undefined) url.searchParams.set(name, String(value));
    }
    return url.toString();
  }

  /** Return the pause before retry number `retry` (0-based): full jitter, capped. */
  backoffMs(retry: number): number {
    return Math.random() * Math.min(this.config.backoffMaxMs, this.config.backoffBaseMs * 2 ** retry);
  }

  /** Send one call and return its decoded JSON answer; throw the mapped error otherwise. */
  async request<T>(method: string, path: string, options: RequestOptions): Promise<T> {
    const url = this.url(path, options.query);
    // The active span's context (a submit's, a send's: the service stores it on the work).
    const trace = traceHeaders();
    const init: RequestInit = { method, headers: this.headers(trace) };
    if (options.body !== undefined) {
      init.body = JSON.stringify(options.body);
      init.headers = this.headers({ ...trace, 'Content-Type': 'application/json' });
    }
    const timeoutMs = this.config.timeoutMs + (options.waitMs ?? 0);
    let retries = 0;
    for (;;) {
      const timeout = AbortSignal.timeout(timeoutMs);
      const signal = options.signal ? AbortSignal.any([timeout, options.signal]) : timeout;
      let delayMs: number;
      let failure: RunstateError;
      try {
        const response = await this.fetchImpl(url, { ...init, signal });
        const text = await response.text();
        if (response.status < 400) return (text ? JSON.parse(text) : null) as T;
        failure = errorFromResponse(response.status, response.statusText, response.headers, text);
        if (!options.idempotent || !RETRYABLE_STATUS.has(response.status)) throw failure;
        delayMs = Math.max(this.backoffMs(retries), retryAfterMs(response.headers) ?? 0);
      } catch (error) {
        if (error instanceof RunstateError) throw error;
        if (options.signal?.aborted) throw options.signal.reason;
        failure = new TransportError(`${method} /v1${path}: ${describe(error)}`, { code: 'TRANSPORT', cause: error });
        if (!options.idempotent) throw failure;
        delayMs = this.backoffMs(retries);
      }
      if (retries >= this.config.maxRetries) throw failure;
      retries += 1;
      await sleep(delayMs, options.signal);
    }
  }

  /**
   * Long-poll `path` (`?timeoutMs=`) until `done(answer)`, looping over the server's 30 s cap.
   *
   * Throw `TimeoutError` once `timeoutMs` (`null`: no limit) has passed.
   */
  async wait<T extends object>(path: string, options: WaitOptions<T>): Promise<T> {
    const { timeoutMs } = options;
    if (timeoutMs !== null && !(timeoutMs >= 0)) throw new RangeError('timeoutMs must be >= 0');
    const deadline = timeoutMs === null ? null : Date.now() + timeoutMs;
    for (;;) {
      const remaining = deadline === null ? MAX_SERVER_WAIT_MS : Math.max(0, deadline - Date.now());
      const chunk = Math.min(remaining, MAX_SERVER_WAIT_MS);
      const answer = await this.request<T>(options.method ?? 'GET', path, {
        idempotent: true,
        query: { timeoutMs: Math.floor(chunk) },
        waitMs: chunk,
      });
      if (options.done(answer)) return answer;
      if (deadline !== null && Date.now() >= deadline) {
        const state = (answer as { state?: unknown }).state;
        throw new TimeoutError(`${options.what} did not finish within ${timeoutMs} ms (state ${String(state)}).`, answer);
      }
    }
  }

  /**
   * Yield the events of one Server-Sent Events connection until the server closes it.
   *
   * Error answers throw the mapped error; comments (heartbeats) are skipped.
   */
  async *eventStream<T>(path: string, query: Query, lastEventId: string | null, signal?: AbortSignal): AsyncGenerator<T> {
    // JSON too: an error answered before the stream starts comes as the usual envelope.
    const headers = this.headers({ Accept: 'text/event-stream, application/json' });
    if (lastEventId !== null) headers['Last-Event-ID'] = lastEventId;
    const init: RequestInit = { method: 'GET', headers };
    if (signal) init.signal = signal;
    let response: Response;
    try {
      response = await this.fetchImpl(this.url(path, query), init);
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      throw new TransportError(`GET /v1${path}: ${describe(error)}`, { code: 'TRANSPORT', cause: error });
    }
    if (response.status >= 400) {
      throw errorFromResponse(response.status, response.statusText, response.headers, await response.text());
    }
    if (response.body === null) return;
    const decoder = new TextDecoder();
    let buffer = '';
    let data: string[] = [];
    try {
      for await (const chunk of response.body) {
        buffer += decoder.decode(chunk as Uint8Array, { stream: true });
        let newline: number;
        while ((newline = buffer.indexOf('\n')) >= 0) {
          const line = buffer.slice(0, newline).replace(/\r$/, '');
          buffer = buffer.slice(newline + 1);
          if (line.startsWith('data:')) {
            data.push(line.slice(5).replace(/^ /, ''));
          } else if (line === '' && data.length > 0) {
            const event = JSON.parse(data.join('\n')) as T;
            data = [];
            yield event;
          }
        }
      }
    } catch (error) {
      if (signal?.aborted) throw signal.reason;
      if (error instanceof RunstateError) throw error;
      throw new TransportError(`GET /v1${path}: ${describe(error)}`, { code: 'TRANSPORT', cause: error });
    }
  }
}
