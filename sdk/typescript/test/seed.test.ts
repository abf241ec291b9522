/**
 * Every TypeScript block of the reference document (`shared/seeds/000_b3519fa2e86ad14e.txt`)
 * runs as written against the live server.
 *
 * The blocks are read from their verbatim copy, `test/seed-blocks.md` (so that the suite needs
 * nothing beside the checkout; `tests/sdk/test_seed_copies.py` checks the copy against the
 * document whenever the document is there), wrapped in a
 * module after a prelude that creates `rs` and defines what the block assumes (`isGoodDraft`, a
 * `run`, a worker or other shards so that it can make progress), type-checked with the
 * package's strict settings, compiled and run; what they print is asserted.
 */

import assert from 'node:assert/strict';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { describe, test } from 'node:test';
import { fileURLToPath, pathToFileURL } from 'node:url';

import ts from 'typescript';

import type { ConsumeSummary, GroupData, RunData, Ticket } from '../src/index.js';

const PACKAGE = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const SEED = join(PACKAGE, 'test', 'seed-blocks.md');

interface Block {
  heading: string;
  source: string;
}

/** Return every ```ts block of the document with the heading it sits under. */
function typescriptBlocks(text: string): Block[] {
  const blocks: Block[] = [];
  let heading = '';
  const lines = text.split('\n');
  for (let index = 0; index < lines.length; index += 1) {
    const line = lines[index] ?? '';
    if (/^#{2,4} /.test(line)) heading = line.replace(/^#+ /, '');
    if (/^```(ts|typescript)\s*$/.test(line)) {
      const body: string[] = [];
      for (index += 1; index < lines.length && !/^```\s*$/.test(lines[index] ?? ''); index += 1) body.push(lines[index] ?? '');
      blocks.push({ heading, source: body.join('\n') });
    }
  }
  return blocks;
}

const BLOCKS = typescriptBlocks(readFileSync(SEED, 'utf8'));

function block(heading: string): string {
  const found = BLOCKS.filter((candidate) => candidate.heading === heading);
  assert.equal(found.length, 1, `one TypeScript block under "${heading}" in ${SEED}`);
  return found[0]?.source ?? '';
}

type Printer = { log: (...args: unknown[]) => void };
type Scenario = (console: Printer) => Promise<Record<string, unknown>>;

/**
 * Write `main(console)` = prelude + verbatim blocks (+ glue), type-check it strictly, compile it
 * and import it. `console` is a parameter so that what the blocks print is captured.
 */
async function compile(name: string, parts: string[]): Promise<Scenario> {
  const dir = join(PACKAGE, 'dist', 'seed-blocks');
  mkdirSync(dir, { recursive: true });
  const file = join(dir, `${name}.ts`);
  const source = [
    "import { Runstate } from '@runstate/client';",
    '',
    'export async function main(console: { log: (...args: unknown[]) => void }): Promise<Record<string, unknown>> {',
    ...parts,
    '}',
    '',
  ].join('\n');
  writeFileSync(file, source);
  const config = ts.readConfigFile(join(PACKAGE, 'tsconfig.json'), (path) => ts.sys.readFile(path));
  const parsed = ts.parseJsonConfigFileContent(config.config, ts.sys, PACKAGE);
  const options: ts.CompilerOptions = { ...parsed.options, rootDir: dir, outDir: dir, declaration: false, sourceMap: false };
  assert.equal(options.strict, true);
  assert.equal(options.noUncheckedIndexedAccess, true);
  const program = ts.createProgram([file], options);
  const diagnostics = ts.getPreEmitDiagnostics(program);
  const report = ts.formatDiagnostics(diagnostics, {
    getCanonicalFileName: (path) => path,
    getCurrentDirectory: () => PACKAGE,
    getNewLine: () => '\n',
  });
  assert.equal(diagnostics.length, 0, `the ${name} scenario does not type-check:\n${report}\n${source}`);
  const emitted = program.emit();
  assert.equal(emitted.emitSkipped, false);
  const module = (await import(pathToFileURL(join(dir, `${name}.js`)).href)) as { main: Scenario };
  return module.main;
}

function printer(): { console: Printer; lines: string[] } {
  const lines: string[] = [];
  return { console: { log: (...args: unknown[]) => lines.push(args.map(String).join(' ')) }, lines };
}

const PRELUDE = ['  const rs = new Runstate(); // RUNSTATE_URL and RUNSTATE_API_KEY from the environment'];

describe('the TypeScript blocks of the reference document', { concurrency: true, timeout: 600_000 }, () => {
  test('the document has the five TypeScript blocks this file runs, and no other', () => {
    assert.deepEqual(
      BLOCKS.map((candidate) => candidate.heading),
      ['Create a group and submit members', 'Record verdicts and wait for the decision', 'Cancel a run', 'Barriers', 'Timers'],
    );
  });

  test('task groups: create, submit 12 drafts, close, review, wait for SUCCESS threshold_reached', async () => {
    const main = await compile('groups', [
      ...PRELUDE,
      '  const isGoodDraft = (outcome: unknown): boolean => (outcome as { draft: number }).draft % 2 === 0;',
      block('Create a group and submit members'),
      '  // Glue: a worker attached to the group run completes the members meanwhile.',
      "  const worker = rs.scope(groupRunId).consume('reviews', (context) => ({ draft: (context.input as { draft: number }).draft }), {",
      '    concurrency: 4,',
      '    handleSignals: false,',
      '  });',
      block('Record verdicts and wait for the decision'),
      '  return { groupRunId, tickets, decision, summary: await worker, group: await group.status() };',
    ]);
    const { console, lines } = printer();
    const result = (await main(console)) as {
      groupRunId: string;
      tickets: Ticket[];
      decision: GroupData;
      summary: ConsumeSummary;
      group: GroupData;
    };

    assert.deepEqual(lines, [`start workers with RUNSTATE_SCOPE_ID=${result.groupRunId}`, 'SUCCESS threshold_reached']);
    assert.equal(result.tickets.length, 12);
    assert.equal(result.decision.state, 'FINALIZED');
    // Finalizing cancelled the group's run: the worker stopped on its own.
    assert.equal(result.summary.stopReason, 'SCOPE_CANCELLED');
    const verdicts = result.group.members.filter((member) => member.verdict !== null);
    const keys = (verdict: string): (string | null)[] =>
      verdicts.filter((member) => member.verdict === verdict).map((member) => member.key);
    assert.deepEqual(keys('ACCEPTED'), [0, 2, 4, 6, 8].map((n) => `draft-${n}`));
    assert.deepEqual(keys('REJECTED'), [1, 3, 5, 7].map((n) => `draft-${n}`));
    // The members nobody judged were completed by the worker or cancelled by the decision.
    for (const member of result.group.members) assert.ok(['SUCCEEDED', 'CANCELLED'].includes(member.state), member.state);
  });

  test('cancel a run: its child shard is ACTIVE but INACTIVE', async () => {
    const main = await compile('cancel', [...PRELUDE, block('Cancel a run'), '  return { run, shard, status, parent: await run.status() };']);
    const { console, lines } = printer();
    const result = (await main(console)) as { run: { id: string }; status: RunData; parent: RunData };

    assert.deepEqual(lines, ['ACTIVE INACTIVE']);
    assert.equal(result.parent.storedState, 'CANCELLED');
    assert.equal(result.status.inactiveReason, 'CANCELLED');
    assert.equal(result.status.inactiveRunId, result.run.id);
  });

  test('barriers: three shards meet', async () => {
    const main = await compile('barriers', [
      ...PRELUDE,
      '  const run = await rs.scopes.create();',
      '  // Glue: the other two shards learn the barrier id from the first arrival event, then arrive too.',
      '  const watching = new AbortController();',
      '  const others = (async () => {',
      "    for await (const event of rs.events.follow({ types: ['barrier.arrived'], runId: run.id, signal: watching.signal })) {",
      "      const other = rs.scope(run.id).barriers.get(event.subjectId ?? '');",
      "      await Promise.all(['shard-1', 'shard-3'].map((key) => other.arrive({ key })));",
      '      return other.wait({ timeoutMs: 30_000 });',
      '    }',
      "    throw new Error('no arrival event');",
      '  })();',
      block('Barriers'),
      '  watching.abort();',
      '  return { barrier, view, others: await others };',
    ]);
    const { console, lines } = printer();
    const result = (await main(console)) as { view: { epoch: number; state: string }; others: { state: string } };

    assert.deepEqual(lines, ['RELEASED 3/3']);
    assert.equal(result.view.epoch, 1);
    assert.equal(result.others.state, 'RELEASED');
  });

  // The block as written, with a one-second delay where the document waits 300 s (as
  // tests/sdk/test_seed.py runs the Python one): the wait is the server's timer firing, and
  // five minutes of it in real time would only make the suite five minutes longer.
  test('timers: fires after its delay (1 s here, 300 s in the document)', async () => {
    const written = block('Timers');
    const timers = written.replace('afterSeconds: 300', 'afterSeconds: 1');
    assert.notEqual(timers, written);
    const main = await compile('timers', [...PRELUDE, '  const run = await rs.scopes.create();', timers, '  return { timer, firedAt };']);
    const { console, lines } = printer();
    const started = Date.now();
    const result = (await main(console)) as { timer: { fireAt: Date; id: string }; firedAt: Date };

    assert.ok(result.timer.fireAt instanceof Date && result.firedAt instanceof Date);
    assert.deepEqual(lines, [`fires at ${result.timer.fireAt.toISOString()}`, `follow-up check at ${result.firedAt.toISOString()}`]);
    assert.ok(result.firedAt.getTime() >= result.timer.fireAt.getTime());
    const delay = result.timer.fireAt.getTime() - started;
    assert.ok(delay > 0 && delay <= 1_000 + 60_000, `fireAt is about 1 s away (${delay} ms)`);
  });
});
