/**
 * The Mesh panel's comm messages: the same shapes as
 * monarch_kernel/kernel/panel/messages.py (kernel -> panel: state, log, reply;
 * panel -> kernel: request).  Types only.
 */

export const COMM_TARGET = 'monarch_kernel.panel';
export const GRID_MIME = 'application/vnd.monarch-kernel.rank-grid+json';

export type RankStateName =
  | 'idle'
  | 'busy'
  | 'debugger'
  | 'pdb'
  | 'not responding'
  | 'dead';

export interface IRankRow {
  rank: number;
  host: string;
  pid: number | null;
  state: RankStateName;
  detail: string;
  cpu: number | null;
  rss_mib: number | null;
  last: string;
  /** The watchdog found this rank's stacks unlike the majority's (while the cell runs). */
  stack_differs: boolean;
}

export interface IMeshRow {
  name: string;
  ranks: number;
  hosts: string[];
  kind: 'local' | 'detached' | 'job';
  job: string;
  current: boolean;
  stopped: boolean;
  dead: number;
  log_seq: number;
  /** Every rank for a small mesh; over SUMMARY_OVER ranks only those not idle, unless expanded. */
  rows: IRankRow[];
  /** How many ranks are in each state (all of them, whatever `rows` holds). */
  counts: Partial<Record<RankStateName, number>>;
  /** `rows` holds only the ranks that are not idle (dead, busy, stopped, not responding). */
  summary: boolean;
  /** The panel asked for the full table (request `table`, full: true): `rows` holds every rank. */
  expanded: boolean;
  /** Live distributed tensors of the mesh (`%mesh tensors` lists them), and their bytes on each rank. */
  tensors?: number;
  tensor_bytes?: number;
}

export interface IJobRow {
  name: string;
  kind: string;
  active: boolean;
  hosts: string[];
  meshes: string[];
}

export interface IPanelState {
  type: 'state';
  meshes: IMeshRow[];
  jobs: IJobRow[];
  running: boolean;
  kernel_id: string;
  debug_target: string;
  protocol: number;
  /** Cells the kernel has begun: a note about what a button did goes when the next one starts. */
  cell?: number;
}

/** [seq, rank, stream, line] */
export type LogLine = [number, number, string, string];

export interface ILogLines {
  type: 'log';
  mesh: string;
  lines: LogLine[];
  since: number;
}

/** A mesh's samples per rank, oldest first (the sparklines); keys are ranks as strings. */
export interface IMetrics {
  type: 'metrics';
  mesh: string;
  ranks: Record<string, { cpu: (number | null)[]; rss_mib: (number | null)[]; gpu?: (number | null)[] }>;
}

export interface IReply {
  type: 'reply';
  id: number;
  ok: boolean;
  message: string;
  /** A text to open in a tab of its own (`stacks`: the grouped stacks). */
  report?: string;
}

export type KernelMessage = IPanelState | ILogLines | IReply | IMetrics;

export type Action =
  | 'hello'
  | 'refresh'
  | 'interrupt'
  | 'restart'
  | 'debug'
  | 'stop'
  | 'use'
  | 'spawn'
  | 'log'
  | 'table'
  | 'stacks'
  | 'metrics';

export interface IRequest {
  action: Action;
  id?: number;
  mesh?: string;
  rank?: number | null;
  ranks?: number[] | null;
  since?: number;
  n?: number;
  name?: string;
  detach?: boolean;
  launcher?: string;
  hosts?: string;
  ssh_args?: string;
  nodes?: number;
  partition?: string;
  time?: string;
  account?: string;
  /** `table`: every rank's row from now on (true) or the summary again (false). */
  full?: boolean;
}

/** What GET /monarch/meshes lists for one detached mesh. */
export interface IDetachedMesh {
  name: string;
  state: 'running' | 'gone';
  ranks: number;
  hosts: string[];
  host_pid: number;
  pids: (number | null)[];
  started: number | null;
  kernel: string | null;
}
