/** Task groups: `run.groups.create` / `byId` and the group handle. */

import { Http, compact, segment, wireTime } from './http.js';
import { sendSpan } from './tracing.js';
import type { GroupCondition, GroupData, GroupDecision, MemberData, VerdictData } from './types.js';
import { Ticket, type WaitTimeout } from './work.js';

/** A handle on a task group; `data` is the group as last seen (`null` until loaded). */
export class Group {
  readonly id: string;
  data: GroupData | null;

  constructor(
    private readonly http: Http,
    id: string,
    data: GroupData | null = null,
  ) {
    this.id = id;
    this.data = data;
  }

  private get path(): string {
    return `/groups/${segment(this.id)}`;
  }

  /** Return the group with every member (`scopeId` is the run its workers attach to). */
  async status(): Promise<GroupData> {
    this.data = await this.http.request<GroupData>('GET', this.path, { idempotent: true });
    return this.data;
  }

  /**
   * Add a member task and return its ticket (`ticket.data.groupState` tells whether it closed the group).
   *
   * With `key` the submit is idempotent (and retried); without one it is sent once.
   */
  async submit(input?: unknown, options: { key?: string } = {}): Promise<Ticket> {
    // A `send` span as a submit's (`tracing.ts`), to the group's mailbox once the group was loaded.
    const task = await sendSpan(
      this.http.config.headers,
      this.data?.mailbox ?? `group ${this.id}`,
      this.data?.scopeId,
      () =>
        this.http.request<MemberData>('POST', `${this.path}/members`, {
          idempotent: options.key !== undefined,
          body: { ...compact({ key: options.key }), input: input ?? {} },
        }),
      (answer) => ({ task_id: answer.id, group_id: answer.groupId }),
    );
    return new Ticket(this.http, task.id, task);
  }

  /** Add an existing task of the same mailbox while the group is open; answer the task and `groupState`. */
  joinTask(taskId: string): Promise<MemberData> {
    return this.http.request('POST', `${this.path}/join`, { idempotent: true, body: { taskId } });
  }

  /** Close the group to new members and evaluate it: `{ state, outcome, outcomeReason }` (idempotent). */
  close(): Promise<GroupDecision> {
    return this.http.request('POST', `${this.path}/close`, { idempotent: true });
  }

  /** Close the group like `close()`, but `ConflictError` `GROUP_FINALIZED` on a finalized group. */
  seal(): Promise<GroupDecision> {
    return this.http.request('POST', `${this.path}/seal`, { idempotent: true });
  }

  /** Accept a succeeded member: `{ taskId, verdict, late, groupState, outcome, outcomeReason }`. */
  accept(taskId: string): Promise<VerdictData> {
    return this.http.request('POST', `${this.path}/members/${segment(taskId)}/accept`, { idempotent: true });
  }

  /** Reject a finished member: `{ taskId, verdict, late, groupState, outcome, outcomeReason }`. */
  reject(taskId: string): Promise<VerdictData> {
    return this.http.request('POST', `${this.path}/members/${segment(taskId)}/reject`, { idempotent: true });
  }

  /** Wait until the group is `FINALIZED` and return it; `TimeoutError` after `timeoutMs` (default 60 s). */
  async wait(options: WaitTimeout = {}): Promise<GroupData> {
    this.data = await this.http.wait<GroupData>(`${this.path}/wait`, {
      done: (group) => group.state === 'FINALIZED',
      timeoutMs: options.timeoutMs === undefined ? 60_000 : options.timeoutMs,
      what: `Group ${this.id}`,
    });
    return this.data;
  }
}

export interface GroupCreateOptions {
  /** The WORK mailbox delivering the members (it must exist). */
  mailbox: string;
  condition: GroupCondition;
  /** For `N_ACCEPTED` (1-100). */
  threshold?: number;
  /** Close the group once this many members joined (1-100). */
  expectedMembers?: number;
  /** Finalize `FAILURE` (`deadline`) if undecided by then. */
  deadline?: Date | string;
  /** The run the group's own run (the gate) is a child of; a root run otherwise. */
  parentScopeId?: string;
  name?: string;
}

/** `run.groups` / `rs.groups`: create groups and re-attach to them. */
export class Groups {
  constructor(private readonly http: Http) {}

  /** Return a handle on the group (no request). */
  byId(groupId: string): Group {
    return new Group(this.http, groupId);
  }

  /** Create a group delivering its members through the WORK `mailbox`; never retried. */
  async create(options: GroupCreateOptions): Promise<Group> {
    const group = await this.http.request<GroupData>('POST', '/groups', {
      idempotent: false,
      body: compact({
        mailbox: options.mailbox,
        condition: options.condition,
        threshold: options.threshold,
        expectedMembers: options.expectedMembers,
        deadline: wireTime(options.deadline),
        parentScopeId: options.parentScopeId,
        name: options.name,
      }),
    });
    return new Group(this.http, group.id, group);
  }
}
