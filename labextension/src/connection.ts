/**
 * One notebook kernel's end of the Mesh panel comm: opens it (monarch kernels only),
 * keeps the last state the kernel sent, and turns requests into promises of replies.
 * It never polls for state: the kernel sends a state when something changed.
 *
 * The kernel answers this comm's messages without a busy/idle status (they are not the
 * notebook's work, and JupyterLab would show their "idle" as the notebook's while a cell
 * runs), so a message's future never finishes: each is dropped once sent (`_sent`); the
 * answers come on the comm.
 */

import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import {
  COMM_TARGET,
  ILogLines,
  IMetrics,
  IPanelState,
  IReply,
  IRequest,
  KernelMessage as PanelMessage
} from './messages';

const IMPLEMENTATION = 'monarch_kernel';
const REPLY_TIMEOUT_MS = 180_000;
// The kernel answers the comm's opening with its state at once; without one by then, the
// comm is opened anew (the answer was lost: a restarted kernel's messages can reach the
// server before its connection to them is made), each wait twice the last.
const HELLO_WAIT_MS = 5_000;
const HELLO_WAIT_MOST_MS = 60_000;

export class MeshConnection {
  constructor(kernel: Kernel.IKernelConnection) {
    this.kernel = kernel;
    kernel.statusChanged.connect(this._onStatus, this);
    void this._open();
  }

  readonly kernel: Kernel.IKernelConnection;

  get state(): IPanelState | null {
    return this._state;
  }

  /** Whether the kernel is a monarch kernel with the panel's comm open. */
  get isOpen(): boolean {
    return this._comm !== null;
  }

  get stateChanged(): ISignal<this, IPanelState | null> {
    return this._stateChanged;
  }

  get logReceived(): ISignal<this, ILogLines> {
    return this._logReceived;
  }

  request(req: IRequest): Promise<IReply> {
    const comm = this._comm;
    if (!comm) {
      return Promise.resolve({
        type: 'reply',
        id: 0,
        ok: false,
        message: 'this notebook does not run the monarch kernel'
      });
    }
    const id = ++this._nextId;
    return new Promise<IReply>(resolve => {
      const timer = window.setTimeout(() => {
        this._pending.delete(id);
        resolve({ type: 'reply', id, ok: false, message: 'the kernel did not answer' });
      }, REPLY_TIMEOUT_MS);
      this._pending.set(id, reply => {
        window.clearTimeout(timer);
        resolve(reply);
      });
      this._sent(comm.send({ type: 'request', ...req, id } as any));
    });
  }

  /** Sample a mesh's ranks now; their history arrives on `metricsReceived`. */
  requestMetrics(mesh: string): void {
    this._send({ type: 'request', action: 'metrics', mesh });
  }

  get metricsReceived(): ISignal<this, IMetrics> {
    return this._metricsReceived;
  }

  /** Ask for a mesh's log lines after `since`; they arrive on `logReceived`. */
  requestLog(mesh: string, since: number): void {
    this._send({ type: 'request', action: 'log', mesh, since });
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    window.clearTimeout(this._helloTimer);
    this.kernel.statusChanged.disconnect(this._onStatus, this);
    const comm = this._comm;
    this._comm = null;
    if (comm && !comm.isDisposed && !this.kernel.isDisposed) {
      try {
        this._sent(comm.close());
      } catch {
        // the kernel is gone already
      }
    }
    Signal.clearData(this);
  }

  private async _open(): Promise<void> {
    if (this._disposed || this._comm || this._opening) {
      return;
    }
    this._opening = true;
    try {
      const info = await this.kernel.info;
      if (this._disposed || info.implementation !== IMPLEMENTATION) {
        return;
      }
      const comm = this.kernel.createComm(COMM_TARGET);
      comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => {
        this._onMessage(msg.content.data as unknown as PanelMessage);
      };
      comm.onClose = () => {
        if (this._comm === comm) {
          this._comm = null;
          this._state = null;
          this._stateChanged.emit(null);
        }
      };
      this._comm = comm;
      this._sent(comm.open({ type: 'request', action: 'hello' } as any));
      window.clearTimeout(this._helloTimer);
      this._helloTimer = window.setTimeout(() => this._noState(comm), this._helloWait);
    } catch (e) {
      console.warn('monarch-kernel panel: could not open its comm', e);
    } finally {
      this._opening = false;
    }
  }

  /** No state came for `comm`'s opening: close it and open another, waiting longer. */
  private _noState(comm: Kernel.IComm): void {
    if (this._disposed || this._comm !== comm || this._state !== null) {
      return;
    }
    this._comm = null;
    this._helloWait = Math.min(2 * this._helloWait, HELLO_WAIT_MOST_MS);
    if (!comm.isDisposed && !this.kernel.isDisposed) {
      try {
        this._sent(comm.close());
      } catch {
        // the kernel is gone: the next status opens a comm to its successor
      }
    }
    void this._open();
  }

  private _send(data: Record<string, unknown>): void {
    if (this._comm) {
      this._sent(this._comm.send(data as any));
    }
  }

  /** The kernel sends no "idle" for the panel's messages: their futures would wait forever. */
  private _sent(future: Kernel.IShellFuture): void {
    future.dispose();
  }

  private _onMessage(msg: PanelMessage): void {
    if (msg.type === 'state') {
      this._helloWait = HELLO_WAIT_MS;
      this._state = msg;
      this._stateChanged.emit(msg);
    } else if (msg.type === 'log') {
      this._logReceived.emit(msg);
    } else if (msg.type === 'metrics') {
      this._metricsReceived.emit(msg);
    } else if (msg.type === 'reply') {
      const done = this._pending.get(msg.id);
      this._pending.delete(msg.id);
      done?.(msg);
    }
  }

  private _onStatus(_: Kernel.IKernelConnection, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead' || status === 'starting') {
      // 'starting' alone says a restart the server made (a REST call, another client): the new
      // process has none of the old one's comms, and the old one's close may never be handled
      // (JupyterLab drops a message of the old session handled after the new one's first)
      this._comm = null;
      this._state = null;
      this._stateChanged.emit(null);
      if (status === 'starting') {
        void this._open(); // its comm target is registered before it says 'starting'
      }
    } else if ((status === 'idle' || status === 'busy') && !this._comm) {
      void this._open(); // after a restart: the new kernel process has no comm yet
    }
  }

  private _comm: Kernel.IComm | null = null;
  private _state: IPanelState | null = null;
  private _opening = false;
  private _helloTimer = 0;
  private _helloWait = HELLO_WAIT_MS;
  private _disposed = false;
  private _nextId = 0;
  private _pending = new Map<number, (reply: IReply) => void>();
  private _stateChanged = new Signal<this, IPanelState | null>(this);
  private _logReceived = new Signal<this, ILogLines>(this);
  private _metricsReceived = new Signal<this, IMetrics>(this);
}
