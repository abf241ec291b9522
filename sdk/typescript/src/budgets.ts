/** Budgets (amounts under a run): `run.budgets.create`, `rs.budgets.reserve` and reservations. */

import { Http, compact, segment } from './http.js';

/** A budget: `remaining = limit - spent - reserved`. */
export interface BudgetData {
  id: string;
  runId: string;
  name: string;
  limit: number;
  spent: number;
  reserved: number;
  remaining: number;
  createdAt: string;
}

/** A reservation on the budgets of a run's chain. */
export interface ReservationData {
  reservationId: string;
  runId: string;
  budget: string;
  amount: number;
  committed: number | null;
  key: string | null;
  state: 'RESERVED' | 'COMMITTED' | 'RELEASED' | 'EXPIRED';
  expiresAt: string;
  createdAt: string;
  settledAt: string | null;
}

export interface ReserveOptions {
  amount: number;
  /** The run spending (default: the handle's run, else `RUNSTATE_SCOPE_ID`). */
  runId?: string;
  ttlMs?: number;
  /** Makes the reservation idempotent: the same key answers the same reservation. */
  key?: string;
}

/** A handle on a budget; `data` is the budget as last seen. */
export class Budget {
  readonly id: string;
  data: BudgetData | null;

  constructor(
    private readonly http: Http,
    id: string,
    data: BudgetData | null = null,
  ) {
    this.id = id;
    this.data = data;
  }

  /** Return the budget. */
  async status(): Promise<BudgetData> {
    this.data = await this.http.request<BudgetData>('GET', `/budgets/${segment(this.id)}`, { idempotent: true });
    return this.data;
  }

  /** Change the limit (`resource_config`); never below what is spent and reserved (`ValidationError`). */
  async setLimit(limit: number): Promise<BudgetData> {
    this.data = await this.http.request<BudgetData>('PATCH', `/budgets/${segment(this.id)}`, {
      body: { limit },
      idempotent: true,
    });
    return this.data;
  }
}

/**
 * A reservation; nothing is sent until `open()` (or `use(fn)`).
 *
 * `use(fn)` opens it, runs `fn(reservation)`, then commits what `fn` reported with `spend(n)`
 * and hands the rest back; nothing reported: releases it all. If `fn` throws, what it reported
 * before is still committed (that spend happened), else everything is released, and the error
 * is rethrown. A `commit` or `release` inside `fn` settles it then.
 */
export class Reservation {
  id: string | null = null;
  data: ReservationData | null = null;
  spent: number | null = null;

  constructor(
    private readonly http: Http,
    private readonly request: Record<string, unknown>,
  ) {}

  /** Make the reservation (`ConflictError` `BUDGET_EXHAUSTED` when a budget lacks room). */
  async open(): Promise<this> {
    this.data = await this.http.request<ReservationData>('POST', '/budget-reservations', {
      idempotent: this.request['key'] !== undefined, // with a key, a repeat answers the same one
      body: this.request,
    });
    this.id = this.data.reservationId;
    return this;
  }

  /** Report `amount` as spent (adds up); committed when `use` ends. */
  spend(amount: number): void {
    if (amount < 0) throw new RangeError('amount must be >= 0');
    this.spent = (this.spent ?? 0) + amount;
  }

  private path(action: string): string {
    if (this.id === null) throw new Error('The reservation is not made yet: call open() or use(fn).');
    return `/budget-reservations/${segment(this.id)}/${action}`;
  }

  /** Record `amount` (default: what `spend` reported, else 0) as spent and hand the rest back. */
  async commit(amount?: number): Promise<ReservationData> {
    this.data = await this.http.request<ReservationData>('POST', this.path('commit'), {
      idempotent: false,
      body: { amount: amount ?? this.spent ?? 0 },
    });
    return this.data;
  }

  /** Hand the whole reservation back (idempotent). */
  async release(): Promise<ReservationData> {
    this.data = await this.http.request<ReservationData>('POST', this.path('release'), { idempotent: true });
    return this.data;
  }

  /** Open, run `fn`, then commit what it reported or release (see the class). */
  async use<T>(fn: (reservation: this) => Promise<T> | T): Promise<T> {
    await this.open();
    try {
      return await fn(this);
    } finally {
      if (this.data?.state === 'RESERVED') {
        if (this.spent !== null) await this.commit(this.spent);
        else await this.release();
      }
    }
  }
}

/** `run.budgets` (create under the run, reserve for it) and `rs.budgets` (look-ups, reserve with `runId`). */
export class Budgets {
  constructor(
    private readonly http: Http,
    private readonly runId: string | null,
  ) {}

  /** Return a handle on the budget (no request). */
  get(budgetId: string): Budget {
    return new Budget(this.http, budgetId);
  }

  /** Create the budget `name` capping everything under the run (needs `resource_config`). */
  async create(name: string, limit: number): Promise<Budget> {
    if (this.runId === null) throw new Error('budgets.create needs a run: use rs.scope(runId).budgets.create(...).');
    const budget = await this.http.request<BudgetData>('POST', `/runs/${segment(this.runId)}/budgets`, {
      idempotent: false,
      body: { name, limit },
    });
    return new Budget(this.http, budget.id, budget);
  }

  /** Return a reservation of `amount` on every budget named `budget` on the run's chain (not sent yet). */
  reserve(budget: string, options: ReserveOptions): Reservation {
    const runId = options.runId || this.runId || process.env['RUNSTATE_SCOPE_ID'];
    if (!runId) throw new Error('No run id: pass runId, or set RUNSTATE_SCOPE_ID.');
    return new Reservation(
      this.http,
      compact({ runId, budget, amount: options.amount, ttlMs: options.ttlMs, key: options.key }),
    );
  }
}
