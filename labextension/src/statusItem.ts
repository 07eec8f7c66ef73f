/**
 * The status bar item: "procs: 4 ranks · 1 dead · rank 1 in debugger" for the current
 * notebook's kernel; clicking it opens the Meshes sidebar.
 */

import { Widget } from '@lumino/widgets';

import { MeshConnection } from './connection';
import { statusText } from './format';
import { IPanelState } from './messages';

export class MeshStatus extends Widget {
  constructor(onClick: () => void) {
    super();
    this.addClass('mk-Status');
    this.node.title = 'Meshes: click to open the panel';
    this.node.addEventListener('click', onClick);
    this._render(null);
  }

  setConnection(connection: MeshConnection | null): void {
    if (connection === this._connection) {
      return;
    }
    this._connection?.stateChanged.disconnect(this._onState, this);
    this._connection = connection;
    connection?.stateChanged.connect(this._onState, this);
    this._render(connection?.state ?? null);
  }

  dispose(): void {
    this._connection?.stateChanged.disconnect(this._onState, this);
    super.dispose();
  }

  private _onState(_: MeshConnection, state: IPanelState | null): void {
    this._render(state);
  }

  private _render(state: IPanelState | null): void {
    const text = statusText(state);
    this.node.textContent = text;
    this.node.hidden = text === '';
  }

  private _connection: MeshConnection | null = null;
}
