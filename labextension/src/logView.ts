/**
 * The log tab: a mesh's recent output lines, every rank's or one rank's, searchable.
 * It asks the kernel for lines newer than the last it holds whenever the kernel's state
 * says the mesh printed more (no timer).
 */

import { Widget } from '@lumino/widgets';

import { MeshConnection } from './connection';
import { h } from './dom';
import { filterLog, mergeLog } from './format';
import { ILogLines, IPanelState, LogLine } from './messages';

export class LogView extends Widget {
  constructor(connection: MeshConnection, mesh: string, rank: number | null, maxLines: number) {
    super();
    this._connection = connection;
    this.mesh = mesh;
    this._rank = rank;
    this._max = maxLines;
    this.addClass('mk-Log');
    this._select = h('select', { class: 'mk-Log-rank', 'aria-label': 'rank' }) as HTMLSelectElement;
    this._search = h('input', { class: 'mk-Log-search', type: 'search', placeholder: 'Search', 'aria-label': 'search' }) as HTMLInputElement;
    this._list = h('pre', { class: 'mk-Log-lines' });
    this._count = h('span', { class: 'mk-Log-count' });
    this.node.append(h('div', { class: 'mk-Log-toolbar' }, 'rank ', this._select, this._search, this._count), this._list);
    this._select.addEventListener('change', () => {
      this._rank = this._select.value === '' ? null : Number(this._select.value);
      this._render();
    });
    this._search.addEventListener('input', () => this._render());
    connection.logReceived.connect(this._onLog, this);
    connection.stateChanged.connect(this._onState, this);
    this._fillRanks(connection.state);
    connection.requestLog(mesh, 0);
  }

  readonly mesh: string;

  /** Show only `rank`'s lines (null: every rank's). */
  setRank(rank: number | null): void {
    this._rank = rank;
    this._select.value = rank === null ? '' : String(rank);
    this._render();
  }

  dispose(): void {
    this._connection.logReceived.disconnect(this._onLog, this);
    this._connection.stateChanged.disconnect(this._onState, this);
    super.dispose();
  }

  private _onLog(_: MeshConnection, msg: ILogLines): void {
    if (msg.mesh !== this.mesh) {
      return;
    }
    this._lines = mergeLog(this._lines, msg.lines, this._max);
    this._asked = false;
    this._render();
  }

  private _onState(_: MeshConnection, state: IPanelState | null): void {
    this._fillRanks(state);
    const mesh = state?.meshes.find(m => m.name === this.mesh);
    const have = this._lines.length ? this._lines[this._lines.length - 1][0] : 0;
    if (mesh && mesh.log_seq > have && !this._asked) {
      this._asked = true;
      this._connection.requestLog(this.mesh, have);
    }
  }

  private _fillRanks(state: IPanelState | null): void {
    const mesh = state?.meshes.find(m => m.name === this.mesh);
    const n = mesh?.ranks ?? 0;
    if (n === this._ranksShown) {
      return;
    }
    this._ranksShown = n;
    const options = [h('option', { value: '' }, 'all')];
    for (let r = 0; r < n; r++) {
      options.push(h('option', { value: String(r) }, String(r)));
    }
    this._select.replaceChildren(...options);
    this._select.value = this._rank === null ? '' : String(this._rank);
  }

  private _render(): void {
    const shown = filterLog(this._lines, this._rank, this._search.value);
    this._list.replaceChildren(
      ...shown.map(([, r, stream, text]) =>
        h('div', { class: 'mk-Log-line', 'data-rank': r, 'data-stream': stream },
          h('span', { class: 'mk-Log-label' }, `[rank ${r}] `), text)
      )
    );
    this._count.textContent = `${shown.length} of ${this._lines.length} lines`;
  }

  private _connection: MeshConnection;
  private _rank: number | null;
  private _max: number;
  private _lines: LogLine[] = [];
  private _asked = false;
  private _ranksShown = -1;
  private _select: HTMLSelectElement;
  private _search: HTMLInputElement;
  private _list: HTMLElement;
  private _count: HTMLElement;
}
