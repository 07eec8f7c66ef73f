/**
 * The Meshes sidebar: every mesh of the current notebook's kernel with a rank grid
 * (rank, host, pid, state, CPU, RSS, last line) and its buttons, then the detached
 * meshes no kernel (or another kernel) has attached.  It redraws when the kernel sends
 * a state; it never polls the kernel.
 */

import { bugIcon, listIcon, refreshIcon, stopIcon, treeViewIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { attachDetached, listDetached, stopDetached } from './api';
import { MeshConnection } from './connection';
import { button, h, iconButton } from './dom';
import {
  countsText,
  formatCpu,
  formatRss,
  formatStarted,
  isLarge,
  meshLabel,
  PAGE_ROWS,
  pageOf,
  stateDetail,
  stateLabel,
  tensorsText
} from './format';
import { IDetachedMesh, IMeshRow, IMetrics, IPanelState, IRankRow, IReply, IRequest } from './messages';
import { sparklines } from './spark';

export interface IMeshPanelOptions {
  /** Open the log tab of `mesh`, filtered to `rank` (null: every rank). */
  showLog: (connection: MeshConnection, mesh: string, rank: number | null) => void;
  /** Ask for a new mesh's settings and spawn it: the kernel's reply (null: the dialog was cancelled). */
  newMesh: (connection: MeshConnection) => Promise<IReply | null>;
  /** Open (or refresh) the tab holding a stacks report of `mesh` (one rank's, or every rank's). */
  showStacks: (mesh: string, rank: number | null, report: string) => void;
}

const METRICS_POLL_MS = 1000;

/** Whether a note still holds in the state `now` (`mesh`: its mesh's row there, if listed). */
type Holds = (now: IPanelState, mesh: IMeshRow | undefined) => boolean;

/** What a panel's message says, whether it is good news, and while it holds: it says what a
 * button did, so it goes when the next cell starts, or sooner when it stops being true. */
interface IBanner {
  text: string;
  ok: boolean;
  holds: Holds;
}

const ALWAYS: Holds = () => true;

export class MeshPanel extends Widget {
  constructor(options: IMeshPanelOptions) {
    super();
    this._options = options;
    this.id = 'monarch-kernel-meshes';
    this.addClass('mk-Panel');
    this.title.caption = 'Meshes (monarch kernel)';
    this._header = h('div', { class: 'mk-Panel-header' });
    this._message = h('div', { class: 'mk-Panel-message', role: 'status' });
    this._body = h('div', { class: 'mk-Panel-meshes' });
    this._detached = h('div', { class: 'mk-Panel-detached' });
    this.node.append(this._header, this._message, this._body, this._detached);
    this._render();
  }

  get connection(): MeshConnection | null {
    return this._connection;
  }

  /** Follow another notebook's kernel (null: no notebook, or not a monarch kernel). */
  setConnection(connection: MeshConnection | null): void {
    if (connection === this._connection) {
      return;
    }
    this._connection?.stateChanged.disconnect(this._onState, this);
    this._connection?.metricsReceived.disconnect(this._onMetrics, this);
    this._connection = connection;
    this._metrics.clear();
    this._banners.clear(); // another kernel's meshes
    this._top = null;
    connection?.stateChanged.connect(this._onState, this);
    connection?.metricsReceived.connect(this._onMetrics, this);
    this._say('');
    this._render();
    void this.refreshDetached();
  }

  /** The New mesh dialog, then the mesh; what the kernel did is said atop the panel until the
   * next cell (whose output tells the notebook too). */
  async newMesh(): Promise<void> {
    const connection = this._connection;
    if (!connection?.state) {
      return;
    }
    const reply = await this._options.newMesh(connection);
    if (reply?.ok && connection === this._connection) {
      const then = connection.state;
      this._say(reply.message, true, undefined, now => (now.cell ?? 0) === (then?.cell ?? 0));
    }
  }

  /** Read the detached meshes again (GET /monarch/meshes). */
  async refreshDetached(): Promise<void> {
    const asked = ++this._listings; // a slow answer to an earlier read must not undo a later one
    let meshes = this._detachedMeshes;
    let error = '';
    try {
      meshes = await listDetached();
    } catch (e) {
      error = `the server extension did not answer: ${(e as Error).message}`;
    }
    if (asked !== this._listings) {
      return;
    }
    this._detachedMeshes = meshes;
    this._detachedError = error;
    this._renderDetached();
  }

  dispose(): void {
    this._connection?.stateChanged.disconnect(this._onState, this);
    super.dispose();
  }

  /** While the panel shows: sample every mesh's ranks once a second (the sparklines). */
  protected onAfterShow(): void {
    this._poll();
  }

  protected onBeforeHide(): void {
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
  }

  private _poll(): void {
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
    }
    this._timer = null;
    if (!this.isVisible || this.isDisposed) {
      return;
    }
    for (const m of this._connection?.state?.meshes ?? []) {
      if (!m.stopped && m.rows.length > 0) {
        this._connection?.requestMetrics(m.name);
      }
    }
    this._timer = window.setTimeout(() => this._poll(), METRICS_POLL_MS);
  }

  private _onMetrics(_: MeshConnection, metrics: IMetrics): void {
    this._metrics.set(metrics.mesh, metrics);
    for (const [rank, series] of Object.entries(metrics.ranks)) {
      const cell = this._body.querySelector(
        `.mk-Mesh[data-mesh="${CSS.escape(metrics.mesh)}"] .mk-Rank[data-rank="${rank}"] .mk-Rank-spark`);
      if (cell) {
        cell.replaceChildren(sparklines(series.cpu, series.rss_mib, series.gpu ?? []));
      }
    }
  }

  private _onState(_: MeshConnection, state: IPanelState | null): void {
    // null: no state (the kernel restarts); its meshes are read again when its first state comes
    const names = state === null ? null : state.meshes.map(m => `${m.name}/${m.kind}`).join(',');
    this._render();
    if (names !== this._meshNames) {
      // A mesh came or went: an attach or a stop shows in Detached too; and what a kernel that
      // was going away still held is read again once its successor answers.
      this._meshNames = names;
      void this.refreshDetached();
    }
  }

  private async _stacks(mesh: string, rank: number | null): Promise<void> {
    const who = rank === null ? `every rank of ${mesh}` : `rank ${rank} of ${mesh}`;
    const reply = await this._do({ action: 'stacks', mesh, rank }, `reading the stacks of ${who}…`,
      (now, _m, then) => now.running === then.running); // the stacks of a cell that has since ended (or begun)
    if (reply.ok && reply.report) {
      this._options.showStacks(mesh, rank, reply.report);
    }
  }

  /** Ask the kernel; say `pending`, then its answer, which holds until the next cell starts and
   * while `holds` (given the state now, the mesh's row now and the state when it was said). */
  private async _do(req: IRequest, pending: string,
    holds?: (now: IPanelState, mesh: IMeshRow | undefined, then: IPanelState) => boolean): Promise<IReply> {
    const connection = this._connection;
    if (!connection) {
      return { type: 'reply', id: 0, ok: false, message: 'no monarch kernel' };
    }
    this._say(pending, true, req.mesh);
    const reply = await connection.request(req);
    const then = connection.state;
    const until: Holds = then === null ? ALWAYS
      : (now, mesh) => (now.cell ?? 0) === (then.cell ?? 0) && (!holds || !reply.ok || holds(now, mesh, then));
    // "stopped procs" outlives procs: the panel says it, not the mesh's box.
    this._say(reply.message, reply.ok, req.action === 'stop' ? undefined : req.mesh, until);
    return reply;
  }

  /** Say `text` in the box of `mesh` (while it is listed: the message goes with it), else atop
   * the panel; it shows while `holds`. */
  private _say(text: string, ok = true, mesh?: string, holds: Holds = ALWAYS): void {
    if (mesh && this._listed(mesh)) {
      this._banners.set(mesh, { text, ok, holds });
      const box = this._body.querySelector(`.mk-Mesh[data-mesh="${CSS.escape(mesh)}"] .mk-Mesh-message`);
      if (box instanceof HTMLElement) {
        this._showBanner(box, text, ok);
      }
      return;
    }
    this._top = text ? { text, ok, holds } : null;
    this._showBanner(this._message, text, ok);
  }

  /** Forget the notes that no longer hold in `state`. */
  private _prune(state: IPanelState): void {
    for (const [name, banner] of [...this._banners.entries()]) {
      const mesh = state.meshes.find(m => m.name === name && !m.stopped);
      if (!mesh || !banner.holds(state, mesh)) {
        this._banners.delete(name); // its mesh stopped, or it is no longer true
      }
    }
    if (this._top && !this._top.holds(state, undefined)) {
      this._top = null;
      this._showBanner(this._message, '', true);
    }
  }

  private _showBanner(el: HTMLElement, text: string, ok: boolean): void {
    el.textContent = text;
    el.dataset.ok = ok ? 'true' : 'false';
    el.hidden = text === '';
  }

  private _listed(mesh: string): boolean {
    return (this._connection?.state?.meshes ?? []).some(m => m.name === mesh && !m.stopped);
  }

  private _render(): void {
    const connection = this._connection;
    const state = connection?.state ?? null;
    this._header.replaceChildren(
      h('span', { class: 'mk-Panel-title' }, 'Meshes'),
      button('New mesh', 'Spawn a new mesh on this kernel', () => {
        void this.newMesh();
      }, { 'data-action': 'new-mesh', ...(state ? {} : { disabled: 'true' }) }),
      button('↻', 'Refresh', () => {
        void connection?.request({ action: 'refresh' });
        void this.refreshDetached();
      }, { 'data-action': 'refresh' })
    );
    if (!connection || !state) {
      this._body.replaceChildren(
        h('p', { class: 'mk-Panel-empty' },
          connection ? 'Connecting to the monarch kernel…' : 'Open a notebook on the "Python 3 (monarch mesh)" kernel.')
      );
      return;
    }
    this._prune(state);
    if (state.meshes.length === 0) {
      this._body.replaceChildren(
        h('p', { class: 'mk-Panel-empty' }, 'No meshes yet: click New mesh, or run  procs = %mesh spawn -n 4')
      );
      return;
    }
    this._body.replaceChildren(...state.meshes.map(m => this._mesh(m, state)));
  }

  private _mesh(mesh: IMeshRow, state: IPanelState): HTMLElement {
    const large = isLarge(mesh);
    const title = h(
      'div',
      { class: 'mk-Mesh-title' },
      h('span', { class: 'mk-Mesh-name' }, mesh.name),
      h('span', { class: 'mk-Mesh-info' },
        ` ${large ? countsText(mesh) : `${mesh.ranks} ranks`} · ${mesh.hosts.join(', ') || 'no hosts'} · ${meshLabel(mesh)}`),
      tensorsText(mesh)
        ? h('span', { class: 'mk-Mesh-tensors', title: 'live distributed tensors (%mesh tensors lists them)' },
          ` · ${tensorsText(mesh)}`)
        : null,
      mesh.current ? h('span', { class: 'mk-Mesh-current', title: 'the current mesh (%%mesh runs here)' }, ' current') : null
    );
    const buttons = h(
      'div',
      { class: 'mk-Mesh-buttons' },
      mesh.current ? null : button('Use', `Make ${mesh.name} the current mesh`, () => {
        void this._do({ action: 'use', mesh: mesh.name }, `making ${mesh.name} current…`, (_now, m) => Boolean(m?.current));
      }, { 'data-action': 'use' }),
      mesh.dead > 0 ? button('Restart dead', `Replace the dead ranks of ${mesh.name}`, () => {
        void this._do({ action: 'restart', mesh: mesh.name }, `restarting the dead ranks of ${mesh.name}…`);
      }, { 'data-action': 'restart-dead' }) : null,
      large ? button(mesh.expanded ? 'Summarise' : 'Show all ranks',
        mesh.expanded ? `List only the ranks of ${mesh.name} that are not idle`
          : `List every rank of ${mesh.name} (${mesh.ranks} rows, paged)`, () => {
          this._pages.delete(mesh.name);
          const full = !mesh.expanded;
          void this._do({ action: 'table', mesh: mesh.name, full },
            mesh.expanded ? `summarising ${mesh.name}…` : `listing every rank of ${mesh.name}…`,
            (_now, m) => Boolean(m?.expanded) === full);
        }, { 'data-action': 'toggle-table', 'aria-pressed': mesh.expanded ? 'true' : 'false' }) : null,
      button('Stacks', `Every rank's stacks of ${mesh.name}, grouped (py-spy; works while a cell runs)`, () => {
        void this._stacks(mesh.name, null);
      }, { 'data-action': 'stacks' }),
      button('Log', `Every rank's recent lines of ${mesh.name}`, () => {
        if (this._connection) {
          this._options.showLog(this._connection, mesh.name, null);
        }
      }, { 'data-action': 'log' }),
      button('Stop', `Stop ${mesh.name} (its ranks end)`, () => {
        void this._do({ action: 'stop', mesh: mesh.name }, `stopping ${mesh.name}…`);
      }, { 'data-action': 'stop' })
    );
    const banner = h('div', { class: 'mk-Mesh-message', role: 'status' });
    const said = this._banners.get(mesh.name);
    this._showBanner(banner, said?.text ?? '', said?.ok ?? true);
    const head = h('tr', {}, ...['rank', 'host', 'pid', 'state', 'CPU', 'RSS', 'history', 'last line', ''].map(c => h('th', {}, c)));
    const page = pageOf(mesh.rows, this._pages.get(mesh.name) ?? 0);
    const rows = page.rows.map(r => this._rank(mesh, r, state));
    const note = mesh.summary
      ? h('div', { class: 'mk-Mesh-note' }, mesh.rows.length === 0
        ? `every rank is idle (Show all ranks lists them)`
        : `${mesh.rows.length} of ${mesh.ranks} ranks are not idle: listed below (Show all ranks lists every rank)`)
      : null;
    return h(
      'section',
      {
        class: 'mk-Mesh',
        'data-mesh': mesh.name,
        'data-kind': mesh.kind,
        'data-summary': mesh.summary ? 'true' : 'false',
        'data-expanded': mesh.expanded ? 'true' : 'false'
      },
      title,
      buttons,
      banner,
      note,
      mesh.rows.length === 0 && mesh.summary
        ? null
        : h('table', { class: 'mk-RankGrid' }, h('thead', {}, head), h('tbody', {}, ...rows)),
      page.pages > 1 ? this._pager(mesh, page.page, page.pages) : null
    );
  }

  /** "‹ rows 101–200 of 1024 (ranks 100–199) ›": a long table's pages (PAGE_ROWS rows each). */
  private _pager(mesh: IMeshRow, page: number, pages: number): HTMLElement {
    const go = (to: number) => {
      this._pages.set(mesh.name, to);
      this._render();
    };
    const size = PAGE_ROWS;
    const first = mesh.rows[page * size]?.rank ?? 0;
    const last = mesh.rows[Math.min(mesh.rows.length, (page + 1) * size) - 1]?.rank ?? 0;
    return h(
      'div',
      { class: 'mk-Pager', 'data-page': page, 'data-pages': pages },
      button('‹', 'Previous rows', () => go(page - 1), {
        'data-action': 'page-previous', ...(page === 0 ? { disabled: 'true' } : {})
      }),
      h('span', { class: 'mk-Pager-info' },
        ` rows ${page * size + 1}–${Math.min(mesh.rows.length, (page + 1) * size)} of ${mesh.rows.length}` +
        ` (ranks ${first}–${last}) `),
      button('›', 'Next rows', () => go(page + 1), {
        'data-action': 'page-next', ...(page === pages - 1 ? { disabled: 'true' } : {})
      })
    );
  }

  private _rank(mesh: IMeshRow, row: IRankRow, state: IPanelState): HTMLElement {
    const dead = row.state === 'dead';
    const debugging = state.debug_target === `${mesh.name}:${row.rank}`;
    const actions = h(
      'td',
      { class: 'mk-Rank-actions' },
      dead ? null : iconButton(stopIcon, 'Interrupt', `Interrupt rank ${row.rank}`, () => {
        void this._do({ action: 'interrupt', mesh: mesh.name, rank: row.rank }, `interrupting rank ${row.rank}…`);
      }, { 'data-action': 'interrupt' }),
      dead ? iconButton(refreshIcon, 'Restart', `Restart rank ${row.rank}`, () => {
        void this._do({ action: 'restart', mesh: mesh.name, rank: row.rank }, `restarting rank ${row.rank}…`);
      }, { 'data-action': 'restart' }) : null,
      dead ? null : iconButton(bugIcon, 'Debug', `Debug rank ${row.rank}: JupyterLab's debugger switches to it (%mesh debug ${row.rank})`, () => {
        void this._do({ action: 'debug', mesh: mesh.name, rank: row.rank }, `pointing the debugger at rank ${row.rank}…`,
          now => now.debug_target === `${mesh.name}:${row.rank}`);
      }, { 'data-action': 'debug', ...(debugging ? { 'aria-pressed': 'true' } : {}) }),
      dead ? null : iconButton(treeViewIcon, 'Stacks', `Rank ${row.rank}'s thread stacks (py-spy)`, () => {
        void this._stacks(mesh.name, row.rank);
      }, { 'data-action': 'rank-stacks' }),
      iconButton(listIcon, 'Log', `Show rank ${row.rank}'s log`, () => {
        if (this._connection) {
          this._options.showLog(this._connection, mesh.name, row.rank);
        }
      }, { 'data-action': 'show-log' })
    );
    return h(
      'tr',
      {
        class: 'mk-Rank', 'data-rank': row.rank, 'data-state': row.state,
        ...(row.stack_differs ? { 'data-stack-differs': 'true' } : {}),
        title: stateDetail(row)
      },
      h('td', { class: 'mk-Rank-rank', title: `rank ${row.rank} · ${row.host}${row.pid === null ? '' : ` · pid ${row.pid}`}` },
        String(row.rank)),
      h('td', { class: 'mk-Rank-host' }, row.host),
      h('td', { class: 'mk-Rank-pid' }, row.pid === null ? '' : String(row.pid)),
      h('td', { class: 'mk-Rank-state', title: stateDetail(row) }, stateLabel(row)),
      h('td', { class: 'mk-Rank-cpu' }, formatCpu(row.cpu)),
      h('td', { class: 'mk-Rank-rss' }, formatRss(row.rss_mib)),
      h('td', { class: 'mk-Rank-spark', title: 'CPU % (blue), RSS (orange) and GPU % (green, where used) over the last minutes' },
        ...this._spark(mesh.name, row.rank)),
      dead
        ? h('td', { class: 'mk-Rank-last', title: row.last },
          row.detail ? h('div', { class: 'mk-Rank-death' }, row.detail) : null,
          row.last ? h('div', { class: 'mk-Rank-lastText' }, row.last) : null)
        : h('td', { class: 'mk-Rank-last', title: row.last }, row.last),
      actions
    );
  }

  private _renderDetached(): void {
    const connection = this._connection;
    const mine = new Set((connection?.state?.meshes ?? []).map(m => m.name));
    const kernelId = connection?.kernel.id ?? '';
    // This kernel's own detached meshes are listed above (or are about to be, their state on its
    // way): they are not "other" meshes, whatever the listing read first.
    const shown = this._detachedMeshes.filter(m => !mine.has(m.name) && !(kernelId && m.kernel === kernelId));
    const rows = shown.map(m =>
      h(
        'tr',
        { class: 'mk-Detached', 'data-mesh': m.name, 'data-state': m.state },
        h('td', { class: 'mk-Detached-name' }, m.name),
        h('td', {}, `${m.ranks} ranks`),
        h('td', {}, m.hosts.join(', ')),
        // Never this notebook's kernel (a restart keeps its id): its meshes are left out above.
        h('td', {}, m.state !== 'running' ? 'gone' : !m.kernel ? 'running' : 'attached to another kernel'),
        h('td', { title: `host pid ${m.host_pid}` }, formatStarted(m.started)),
        h(
          'td',
          { class: 'mk-Rank-actions' },
          m.state === 'running' && kernelId ? button('Attach', `Attach ${m.name} to this notebook's kernel`, () => {
            this._say(`attaching ${m.name}…`);
            attachDetached(m.name, kernelId).then(
              msg => this._say(msg),
              e => this._say((e as Error).message, false)
            ).finally(() => void this.refreshDetached());
          }, { 'data-action': 'attach' }) : null,
          button('Stop', `Stop ${m.name}: its ranks end`, () => {
            this._say(`stopping ${m.name}…`);
            stopDetached(m.name).then(
              msg => this._say(msg),
              e => this._say((e as Error).message, false)
            ).finally(() => void this.refreshDetached());
          }, { 'data-action': 'stop' })
        )
      )
    );
    this._detached.replaceChildren(
      h('div', { class: 'mk-Panel-subtitle' }, 'Detached'),
      this._detachedError ? h('p', { class: 'mk-Panel-empty' }, this._detachedError) : '',
      shown.length === 0 && !this._detachedError
        ? h('p', { class: 'mk-Panel-empty' }, 'No other detached meshes.')
        : h('table', { class: 'mk-RankGrid' }, h('tbody', {}, ...rows))
    );
  }

  private _spark(mesh: string, rank: number): SVGElement[] {
    const series = this._metrics.get(mesh)?.ranks[String(rank)];
    return series ? [sparklines(series.cpu, series.rss_mib, series.gpu ?? [])] : [];
  }

  private _options: IMeshPanelOptions;
  private _metrics = new Map<string, IMetrics>(); // mesh -> its last samples
  private _banners = new Map<string, IBanner>(); // mesh -> the last message about it
  private _top: IBanner | null = null; // the message atop the panel, about no listed mesh
  private _timer: number | null = null;
  private _connection: MeshConnection | null = null;
  private _header: HTMLElement;
  private _message: HTMLElement;
  private _body: HTMLElement;
  private _detached: HTMLElement;
  private _detachedMeshes: IDetachedMesh[] = [];
  private _detachedError = '';
  private _meshNames: string | null = '';
  private _listings = 0; // reads of the detached meshes asked
  private _pages = new Map<string, number>(); // mesh -> the page of its table shown
}
