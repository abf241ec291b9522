/**
 * The message loop behind `scope.consumeMessages`: receive, extend in the background, answer, stop.
 *
 * The queue twin of the task loop (`worker.ts`), on the same skeleton (`loop.ts`: fetch loop,
 * `SIGTERM` and `stop()`, draining, the context's signal). A handler's return acknowledges the
 * message (`complete`), a throw puts it back after `retryDelayMs` (`retry`), and `Reject`
 * dead-letters it (`reject`). While a handler runs, its delivery is extended every
 * `extendFraction` of the visibility, so a slow handler keeps its message. When an extend or
 * the answer is refused with the run's code (the run was cancelled, completed or passed its
 * deadline) or `LEASE_LOST`, the delivery is lost: its context's signal aborts, nothing more
 * is sent for it, and the summary counts it. A promise cannot be cancelled: the loop stops
 * waiting for a lost handler and drops its result; pass `context.signal` to your I/O.
 *
 * Traced as the task loop is (`tracing.ts`): a `process` span, child of the sender's
 * (the delivery's `traceparent`), around the handler, and a `settle` span for its answer.
 */

import { ScopeInactiveError } from './errors.js';
import { Http, sleep } from './http.js';
import {
  FetchLoop,
  HandlerContext,
  MIN_RENEW_INTERVAL_MS,
  freshHeld,
  isExpectedRefusal,
  isTransient,
  settle,
  type HeldItem,
  type Settled,
  type LoopOptions,
  type LoopSummary,
} from './loop.js';
import { ProcessSpan } from './tracing.js';
import type { DeliveryData, MessageData } from './types.js';
import { Delivery, Messages } from './work.js';

/** The server's cap on `max` of one receive. */
const MAX_DELIVERIES_PER_CALL = 100;

/**
 * Throw from a message handler to dead-letter its message with `reason` (no retry), as
 * Python's `runstate.Reject`.
 */
export class Reject extends Error {
  /** Recorded as the message's `deadLetterReason` (`null`: none). */
  readonly reason: string | null;

  constructor(reason?: string) {
    super(reason ?? 'message rejected');
    this.name = 'Reject';
    this.reason = reason ?? null;
  }
}

/** What a message handler gets: the delivered message, and whether (and why) it should stop. */
export class MessageContext<B = unknown> extends HandlerContext {
  /** The message's body, as sent. */
  readonly body: B;
  readonly messageId: string;
  /** Fences every answer: a later delivery of the same message has another id. */
  readonly deliveryId: string;
  /** 1 for the first delivery of the message, 2 after a retry or a visibility that ran out... */
  readonly attempt: number;
  /** The delivery as received (`visibleUntil` is the visibility it was received with). */
  readonly delivery: DeliveryData;
  // `signal` aborts when the delivery is lost (`lease_lost`, `scope_refused`) or the loop gives
  // up on the handler while stopping (`stopping`); every method is bound to the context, so a
  // handler may destructure it: `async ({ body, signal, isLost }) => ...`.

  /** @internal */
  constructor(delivery: Delivery) {
    super(`message ${delivery.messageId}`);
    this.body = delivery.body as B;
    this.messageId = delivery.messageId;
    this.deliveryId = delivery.id;
    this.attempt = delivery.attempt;
    this.delivery = delivery.data;
  }

  /** Return whether the delivery is lost: the handler's result will not be recorded. */
  readonly isLost = (): boolean => this.lostWork;

  /** Whether the delivery is lost (as `isLost()`). */
  get lost(): boolean {
    return this.lostWork;
  }

  /** @internal The answer was refused: the delivery is lost. */
  markLost(reason: 'lease_lost' | 'scope_refused'): void {
    this.trip(reason, true);
  }
}

/** A message handler: its return acknowledges the message, a throw retries it, `Reject` dead-letters it. */
export type MessageHandler<B = unknown> = (context: MessageContext<B>) => unknown;

/** What a message loop did before it resolved. */
export interface MessageSummary extends LoopSummary {
  /** Messages acknowledged. */
  completed: number;
  /** Messages put back after a handler's throw. */
  retried: number;
  /** Messages dead-lettered by the handler's `Reject`. */
  rejected: number;
  /**
   * Messages the server dead-lettered (reason `max_attempts`) instead of retrying: the
   * handler threw on the message's last allowed delivery (the mailbox's `maxAttempts`).
   */
  deadLettered: number;
  /** Deliveries lost (an extend or the answer refused: the run's code, `LEASE_LOST`). */
  lost: number;
  /** Messages put back at once when stopping. */
  released: number;
  /** `"stopped"` (`stop()`, `SIGTERM`, the `signal` option) or the run's refusal code (`SCOPE_CANCELLED`...). */
  stopReason: string;
}

/** `concurrency`, `drainTimeoutMs`, `handleSignals`, `signal` and `log` (see `LoopOptions`), and: */
export interface MessageConsumeOptions extends LoopOptions {
  /** How long each delivery stays hidden, and each extend hides it for (default: the mailbox's `leaseTtlMs`). */
  visibilityMs?: number;
  /** After a handler's throw, the message is visible again after this long (default 0). */
  retryDelayMs?: number;
  /** How long one receive may wait for messages (30 000 at most, the default). */
  receiveWaitMs?: number;
  /** Extend each delivery every this fraction of the visibility (default 1/3). */
  extendFraction?: number;
}

interface Held extends HeldItem {
  readonly delivery: Delivery;
  readonly context: MessageContext<unknown>;
  /** When the visibility runs out at the latest, by this process's clock. */
  visibleUntil: number;
  /** The handler's `process` span (`null` when nothing traces). */
  readonly span: ProcessSpan | null;
}

type Counter = 'completed' | 'retried' | 'rejected';

/** A message loop on one run and QUEUE mailbox: `await worker.run()`; `worker.stop()` ends it. */
export class MessageWorker extends FetchLoop<Delivery, Held, MessageSummary> {
  readonly summary: MessageSummary = {
    completed: 0,
    retried: 0,
    rejected: 0,
    deadLettered: 0,
    lost: 0,
    released: 0,
    stopReason: '',
  };
  private readonly messages: Messages;
  private readonly handler: MessageHandler<unknown>;
  private readonly retryDelayMs: number;
  private readonly receiveWaitMs: number;
  private readonly extendFraction: number;

  constructor(
    http: Http,
    runId: string,
    mailbox: string,
    handler: MessageHandler<any>,
    options: MessageConsumeOptions = {},
  ) {
    const receiveWaitMs = Math.max(0, Math.min(options.receiveWaitMs ?? 30_000, 30_000));
    super(http, runId, mailbox, options, { leaseMs: options.visibilityMs, fetchWaitMs: receiveWaitMs });
    const extendFraction = options.extendFraction ?? 1 / 3;
    if (!(extendFraction > 0 && extendFraction < 1)) throw new RangeError('extendFraction must be between 0 and 1');
    this.messages = new Messages(http, runId);
    this.handler = handler;
    this.retryDelayMs = options.retryDelayMs ?? 0;
    this.receiveWaitMs = receiveWaitMs;
    this.extendFraction = extendFraction;
  }

  protected fetch(max: number, signal: AbortSignal): Promise<Delivery[]> {
    return this.messages.receive(this.mailbox, {
      max: Math.min(max, MAX_DELIVERIES_PER_CALL),
      visibilityMs: this.leaseMs,
      waitMs: this.receiveWaitMs,
      signal,
    });
  }

  protected handBack(delivery: Delivery): Promise<void> {
    return this.putBack(delivery);
  }

  protected abandon(held: Held): Promise<void> {
    return this.putBack(held.delivery);
  }

  protected label(held: Held): string {
    return `message ${held.delivery.messageId}: delivery`;
  }

  // Running one message ----------------------------------------------------------------------

  protected start(delivery: Delivery): void {
    const held: Held = {
      delivery,
      context: new MessageContext<unknown>(delivery),
      visibleUntil: Date.now() + this.leaseMs,
      span: ProcessSpan.start(this.mailbox, {
        traceparent: delivery.data.traceparent,
        tracestate: delivery.data.tracestate,
        runId: this.runId,
        messageId: delivery.messageId,
        attempt: delivery.attempt,
      }),
      ...freshHeld(),
    };
    this.held.set(delivery.id, held);
    held.done = this.supervise(held);
  }

  private async supervise(held: Held): Promise<void> {
    try {
      const keeping = new AbortController();
      const keeper = this.keepVisible(held, keeping.signal);
      const handler = this.handler;
      const call = (): Promise<Settled> => settle(() => handler(held.context));
      const running = held.span ? held.span.run(call) : call();
      const settled = await Promise.race([running, held.dropped.then(() => null)]);
      keeping.abort();
      await keeper; // an extend in flight decides whether the delivery is still held
      if (settled === null || held.lost || held.abandoned) {
        // The delivery is gone (counted by lose()) or put back by the shutdown: the result cannot count.
        return;
      }
      held.recording = true;
      const { delivery } = held;
      if (settled.ok) {
        await this.answer(held, () => delivery.complete(), 'completed');
      } else if (settled.error instanceof Reject) {
        const { reason } = settled.error;
        await this.answer(held, () => delivery.reject(reason === null ? {} : { reason }), 'rejected');
      } else {
        this.log('warn', `message ${delivery.messageId} attempt ${delivery.attempt} failed: ${String(settled.error)}`);
        held.span?.fail(settled.error);
        await this.answer(held, () => delivery.retry({ delayMs: this.retryDelayMs }), 'retried');
      }
    } finally {
      held.span?.end();
      this.held.delete(held.delivery.id);
      this.wake();
    }
  }

  /**
   * Extend the delivery every `extendFraction` of the visibility until `signal` aborts.
   *
   * An extend that fails in transit is tried again at the next tick until the visibility would
   * have run out; a refusal (the run's code, `LEASE_LOST`) loses the delivery.
   */
  private async keepVisible(held: Held, signal: AbortSignal): Promise<void> {
    const interval = Math.max(MIN_RENEW_INTERVAL_MS, this.leaseMs * this.extendFraction);
    while (!held.lost) {
      try {
        await sleep(interval, signal);
      } catch {
        return;
      }
      const sent = Date.now();
      try {
        await held.delivery.extend(this.leaseMs);
      } catch (error) {
        if (error instanceof ScopeInactiveError) {
          this.lose(held, 'scope_refused');
          return;
        }
        if (isTransient(error)) {
          this.log('warn', `extend of message ${held.delivery.messageId} failed (${String(error)})`);
          if (Date.now() >= held.visibleUntil) {
            this.lose(held, 'lease_lost');
            return;
          }
          continue;
        }
        this.lose(held, 'lease_lost');
        return;
      }
      held.visibleUntil = sent + this.leaseMs;
    }
  }

  /** Send the handler's answer (in a `settle` span when traced); count what became of the message (the server may dead-letter a retry). */
  private async answer(held: Held, call: () => Promise<MessageData>, counter: Counter): Promise<void> {
    let message: MessageData;
    try {
      message = await (held.span ? held.span.settle(counter, call) : call());
    } catch (error) {
      this.summary.lost += 1;
      held.context.markLost(error instanceof ScopeInactiveError ? 'scope_refused' : 'lease_lost');
      this.log(isExpectedRefusal(error) ? 'info' : 'error', `message ${held.delivery.messageId}: answer not recorded (${String(error)})`);
      return;
    }
    if (counter === 'retried' && message.state === 'DEAD_LETTERED') {
      this.summary.deadLettered += 1;
      this.log(
        'warn',
        `message ${message.id} dead-lettered (${String(message.deadLetterReason)}) after ${message.attempts} deliveries`,
      );
      return;
    }
    this.summary[counter] += 1;
  }

  /** Put the message back at once (stopping); counted as released. */
  private async putBack(delivery: Delivery): Promise<void> {
    try {
      await delivery.retry({ delayMs: 0 });
      this.summary.released += 1;
    } catch (error) {
      this.log('info', `message ${delivery.messageId}: hand-back refused (${String(error)})`);
    }
  }
}
