/**
 * Pure helpers: the words and numbers the panel, the status bar and the log tab show.
 * No DOM, no JupyterLab: unit-testable on their own.
 */

import { IMeshRow, IPanelState, IRankRow, LogLine, RankStateName } from './messages';

/** The order the counts of a summarised mesh are told in. */
export const STATE_ORDER: RankStateName[] = ['idle', 'busy', 'debugger', 'pdb', 'not responding', 'dead'];

/** At most this many rank rows are drawn at once; longer tables are paged. */
export const PAGE_ROWS = 100;

/** "procs: 4 ranks · 1 dead · rank 1 in debugger" for the current mesh ("" if none). */
export function statusText(state: IPanelState | null): string {
  if (!state || state.meshes.length === 0) {
    return '';
  }
  const mesh = state.meshes.find(m => m.current) ?? state.meshes[0];
  const parts = [`${mesh.name}: ${mesh.ranks} rank${mesh.ranks === 1 ? '' : 's'}`];
  if (mesh.dead > 0) {
    parts.push(`${mesh.dead} dead`);
  }
  const busy = mesh.counts?.busy ?? mesh.rows.filter(r => r.state === 'busy').length;
  if (busy > 0) {
    parts.push(`${busy} busy`);
  }
  for (const r of mesh.rows) {
    if (r.state === 'debugger') {
      parts.push(`rank ${r.rank} in debugger`);
    } else if (r.state === 'pdb') {
      parts.push(`rank ${r.rank} in pdb`);
    }
  }
  const others = state.meshes.length - 1;
  if (others > 0) {
    parts.push(`+${others} mesh${others === 1 ? '' : 'es'}`);
  }
  return parts.join(' · ');
}

/** Whether the kernel summarises this mesh (over its SUMMARY_OVER ranks), expanded or not. */
export function isLarge(mesh: IMeshRow): boolean {
  return Boolean(mesh.summary || mesh.expanded);
}

/** "1024 ranks · idle 1020 · busy 3 · dead 1": the counts by state of a mesh. */
export function countsText(mesh: IMeshRow): string {
  const counts: Record<string, number> = { ...(mesh.counts ?? {}) };
  const known = STATE_ORDER.filter(s => counts[s]);
  const others = Object.keys(counts).filter(s => counts[s] && !STATE_ORDER.includes(s as RankStateName)).sort();
  return [`${mesh.ranks} rank${mesh.ranks === 1 ? '' : 's'}`, ...[...known, ...others].map(s => `${s} ${counts[s]}`)]
    .join(' · ');
}

/** The rows of page `page` (clamped) of a table of `rows`, `size` a page. */
export function pageOf<T>(rows: T[], page: number, size: number = PAGE_ROWS): { rows: T[]; page: number; pages: number } {
  const pages = Math.max(1, Math.ceil(rows.length / size));
  const at = Math.min(Math.max(0, page), pages - 1);
  return { rows: rows.slice(at * size, (at + 1) * size), page: at, pages };
}

/** A rank's state in a few words, to fit a narrow panel: "dead · SIGKILL", "dead · exit 3",
 * "not responding · 12 s" (`stateDetail` has the whole sentence). */
export function stateLabel(row: IRankRow): string {
  const base = baseStateLabel(row);
  return row.stack_differs ? `${base} · stack differs` : base;
}

/** A rank's state in full, for its tooltip: "dead: killed by signal 9 (SIGKILL)". */
export function stateDetail(row: IRankRow): string {
  const full = row.detail ? `${row.state}: ${row.detail}` : row.state;
  return row.stack_differs ? `${full} (its stacks differ from the majority's: press Stacks)` : full;
}

/** "SIGKILL", "exit 3", "lost": how a rank died, from the kernel's words for it. */
export function shortDeath(detail: string): string {
  const signal = /signal \d+ \((\w+)\)/.exec(detail) ?? /signal (\d+)/.exec(detail);
  if (signal) {
    return /^\d+$/.test(signal[1]) ? `signal ${signal[1]}` : signal[1];
  }
  const code = /code (-?\d+)/.exec(detail);
  if (code) {
    return `exit ${code[1]}`;
  }
  return /^lost\b/.test(detail) ? 'lost' : detail;
}

function baseStateLabel(row: IRankRow): string {
  switch (row.state) {
    case 'dead':
      return row.detail ? `dead · ${shortDeath(row.detail)}` : 'dead';
    case 'debugger':
      return 'stopped (debugger)';
    case 'pdb':
      return 'stopped (pdb)';
    case 'not responding':
      return row.detail ? `not responding · ${row.detail.replace(/^silent /, '')}` : 'not responding';
    default:
      return row.state;
  }
}

/** How a mesh is doing: "running", "detached", "2 dead", "stopped" (no dead count for a
 * summarised mesh: its counts by state hold it). */
export function meshLabel(mesh: IMeshRow): string {
  const words: string[] = [];
  if (mesh.stopped) {
    words.push('stopped');
  } else if (mesh.kind === 'detached') {
    words.push('detached');
  } else if (mesh.kind === 'job') {
    words.push(`job ${mesh.job}`);
  } else {
    words.push('running');
  }
  if (mesh.dead > 0 && !mesh.stopped && !isLarge(mesh)) {
    words.push(`${mesh.dead} dead`); // a summarised mesh's counts say it already
  }
  return words.join(', ');
}

/** "3 tensors, 1.5 KiB per rank": a mesh's live distributed tensors ("" when it has none). */
export function tensorsText(mesh: IMeshRow): string {
  const n = mesh.tensors ?? 0;
  if (n === 0) {
    return '';
  }
  return `${n} tensor${n === 1 ? '' : 's'}, ${formatBytes(mesh.tensor_bytes ?? 0)} per rank`;
}

export function formatBytes(n: number): string {
  const units = ['bytes', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i === 0 ? `${n} bytes` : `${n < 10 ? n.toFixed(1) : Math.round(n)} ${units[i]}`;
}

export function formatCpu(cpu: number | null): string {
  return cpu === null ? '' : `${Math.round(cpu)}%`;
}

export function formatRss(mib: number | null): string {
  if (mib === null) {
    return '';
  }
  return mib >= 1024 ? `${(mib / 1024).toFixed(1)} GiB` : `${Math.round(mib)} MiB`;
}

export function formatStarted(epochSeconds: number | null): string {
  if (epochSeconds === null) {
    return '';
  }
  return new Date(epochSeconds * 1000).toLocaleString();
}

/** The log lines a rank filter and a search keep, oldest first. */
export function filterLog(
  lines: LogLine[],
  rank: number | null,
  search: string
): LogLine[] {
  const needle = search.toLowerCase();
  return lines.filter(
    ([, r, , text]) =>
      (rank === null || r === rank) &&
      (needle === '' || text.toLowerCase().includes(needle))
  );
}

/** Merge newly fetched lines into what the log holds, keeping at most `max`. */
export function mergeLog(
  have: LogLine[],
  fresh: LogLine[],
  max: number
): LogLine[] {
  const last = have.length ? have[have.length - 1][0] : 0;
  const merged = have.concat(fresh.filter(l => l[0] > last));
  return merged.length > max ? merged.slice(merged.length - max) : merged;
}
