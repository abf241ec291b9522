/** Admissions: `run.admissions` (room for at most `maxActive` child runs at once) and their handles. */

import { randomUUID } from 'node:crypto';

import { Http, MAX_SERVER_WAIT_MS, compact, segment, wireTime } from './http.js';
import type { RunData } from './types.js';

export type AdmissionState = 'WAITING' | 'ADMITTED' | 'WITHDRAWN' | 'CANCELLED';

/** An admission as the API answers it; `run` is the admitted child run, `null` until admitted. */
export interface AdmissionData {
  admissionId: string;
  state: AdmissionState;
  /** The place in line while waiting (1 is next); `null` otherwise. */
  position: number | null;
  run: RunData | null;
  parentRunId: string;
  key: string | null;
  name: string;
  deadline: string | null;
  createdAt: string;
  admittedAt: string | null;
  endedAt: string | null;
  /** The code a cancelled admission answers (`SCOPE_CANCELLED`, ...). */
  endCode: string | null;
}

/** A run's admission limit and its use. */
export interface AdmissionConfigData {
  runId: string;
  /** `null`: no limit configured (every admission is admitted at once). */
  maxActive: number | null;
  admitted: number;
  waiting: number;
  updatedAt: string;
}

export interface AdmissionRequestOptions {
  name?: string;
  /** Makes the request idempotent; made up when not given, so a retry or `wait()` finds the same admission. */
  key?: string;
  /** Wait in line up to this long (longer than 30 s loops over the server's cap). Default 0. */
  waitMs?: number;
  /** The child run's deadline (must be in the future). */
  deadline?: Date | string;
}

/** A handle on an admission; `data` is the admission as last seen (`null` until loaded). */
export class Admission {
  readonly id: string;
  data: AdmissionData | null;
  private parentId: string | null;
  private key: string | null;

  constructor(
    private readonly http: Http,
    id: string,
    data: AdmissionData | null = null,
    parentId: string | null = null,
  ) {
    this.id = id;
    this.data = data;
    this.parentId = data?.parentRunId ?? parentId;
    this.key = data?.key ?? null;
  }

  /** The state as last seen (`null` until loaded). */
  get state(): AdmissionState | null {
    return this.data?.state ?? null;
  }

  /** The place in line as last seen (1 is next), `null` unless waiting. */
  get position(): number | null {
    return this.data?.position ?? null;
  }

  /** The admitted child run as last seen, `null` until admitted (`rs.scope(run.id)` for a handle). */
  get run(): RunData | null {
    return this.data?.run ?? null;
  }

  private remember(data: AdmissionData): AdmissionData {
    this.data = data;
    this.parentId = data.parentRunId;
    this.key = data.key;
    return data;
  }

  /** Return the admission (`GET /admissions/{id}`). */
  async status(): Promise<AdmissionData> {
    return this.remember(
      await this.http.request<AdmissionData>('GET', `/admissions/${segment(this.id)}`, { idempotent: true }),
    );
  }

  /**
   * Wait in line until admitted, at most `waitMs` (default 30 s; `null`: no limit); return this admission.
   *
   * Still waiting after `waitMs`: `state` stays `WAITING` and the request keeps its place. Throws
   * the run's refusal (`ScopeCancelledError`...) if the parent ends meanwhile.
   */
  async wait(options: { waitMs?: number | null } = {}): Promise<Admission> {
    const limit = options.waitMs === undefined ? 30_000 : options.waitMs;
    if (this.key === null || this.parentId === null) await this.status();
    if (this.key === null || this.parentId === null) return this; // made without a key: one read is all we can do
    const deadline = limit === null ? null : Date.now() + limit;
    for (;;) {
      const remaining = deadline === null ? MAX_SERVER_WAIT_MS : Math.max(0, deadline - Date.now());
      const chunk = Math.min(remaining, MAX_SERVER_WAIT_MS);
      this.remember(
        await this.http.request<AdmissionData>('POST', `/runs/${segment(this.parentId)}/admissions`, {
          idempotent: true, // the key makes a repeat find the same admission
          body: { key: this.key, waitMs: chunk },
          waitMs: chunk,
        }),
      );
      if (this.state !== 'WAITING' || (deadline !== null && Date.now() >= deadline)) return this;
    }
  }

  /** Leave the line (`WITHDRAWN`); `ConflictError` `INVALID_STATE` once admitted. */
  async withdraw(): Promise<AdmissionData> {
    return this.remember(
      await this.http.request<AdmissionData>('POST', `/admissions/${segment(this.id)}/withdraw`, { idempotent: true }),
    );
  }
}

/** `run.admissions`: ask for room for a child run of this run, and set the limit. */
export class Admissions {
  constructor(
    private readonly http: Http,
    private readonly runId: string,
  ) {}

  private get path(): string {
    return `/runs/${segment(this.runId)}`;
  }

  /** Return a handle on the admission (no request). */
  get(admissionId: string): Admission {
    return new Admission(this.http, admissionId, null, this.runId);
  }

  /** Let at most `maxActive` admitted children of the run be active at once (needs `resource_config`). */
  async configure(options: { maxActive: number }): Promise<AdmissionConfigData> {
    return this.http.request<AdmissionConfigData>('PUT', `${this.path}/admission`, {
      idempotent: true,
      body: { maxActive: options.maxActive },
    });
  }

  /** Return the run's limit and use: `{runId, maxActive, admitted, waiting}`. */
  async status(): Promise<AdmissionConfigData> {
    return this.http.request<AdmissionConfigData>('GET', `${this.path}/admission`, { idempotent: true });
  }

  /**
   * Ask for a child run: admitted at once when there is room and nobody waits, else in line.
   *
   * The answer's `state` says which; `run` is the new child once admitted. Throws the run's
   * refusal (`ScopeCancelledError`...) under an inactive run.
   */
  async request(options: AdmissionRequestOptions = {}): Promise<Admission> {
    const key = options.key ?? `sdk-${randomUUID()}`;
    const waitMs = Math.max(0, options.waitMs ?? 0);
    const chunk = Math.min(waitMs, MAX_SERVER_WAIT_MS);
    const data = await this.http.request<AdmissionData>('POST', `${this.path}/admissions`, {
      idempotent: true, // the key makes a repeat find the same admission
      body: compact({ name: options.name, key, waitMs: chunk, deadline: wireTime(options.deadline) }),
      waitMs: chunk,
    });
    const admission = new Admission(this.http, data.admissionId, data, this.runId);
    if (admission.state === 'WAITING' && waitMs > chunk) await admission.wait({ waitMs: waitMs - chunk });
    return admission;
  }
}
