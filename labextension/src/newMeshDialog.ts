/**
 * The New mesh dialog's body: rank count, name, detached, and the launcher (this machine,
 * a new ssh or slurm job, or one of the kernel's running jobs) with that launcher's fields.
 */

import { Dialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { h } from './dom';
import { IJobRow, IRequest } from './messages';

export class NewMeshBody extends Widget implements Dialog.IBodyWidget<IRequest> {
  constructor(jobs: IJobRow[]) {
    super();
    this.addClass('mk-NewMesh');
    const field = (label: string, input: HTMLElement, cls = '') =>
      h('label', { class: `mk-NewMesh-field ${cls}` }, h('span', {}, label), input);
    this._n = h('input', { type: 'number', min: 1, value: 4, name: 'n' }) as HTMLInputElement;
    this._name = h('input', { type: 'text', name: 'name', placeholder: 'procs' }) as HTMLInputElement;
    this._detach = h('input', { type: 'checkbox', name: 'detach' }) as HTMLInputElement;
    this._launcher = h('select', { name: 'launcher' },
      h('option', { value: 'local' }, 'this machine'),
      ...jobs.filter(j => j.active).map(j => h('option', { value: j.name }, `job ${j.name} (${j.kind}: ${j.hosts.join(', ')})`)),
      h('option', { value: 'ssh' }, 'new ssh job'),
      h('option', { value: 'slurm' }, 'new slurm job')
    ) as HTMLSelectElement;
    this._hosts = h('input', { type: 'text', name: 'hosts', placeholder: 'h1,h2' }) as HTMLInputElement;
    this._sshArgs = h('input', { type: 'text', name: 'ssh_args', placeholder: '-i key -l me' }) as HTMLInputElement;
    this._nodes = h('input', { type: 'number', min: 1, value: 1, name: 'nodes' }) as HTMLInputElement;
    this._partition = h('input', { type: 'text', name: 'partition' }) as HTMLInputElement;
    this._time = h('input', { type: 'text', name: 'time', placeholder: '01:00:00' }) as HTMLInputElement;
    this._account = h('input', { type: 'text', name: 'account' }) as HTMLInputElement;
    this.node.append(
      field('Ranks', this._n),
      field('Name', this._name),
      field('Detached (keeps running after the kernel ends)', this._detach, 'mk-NewMesh-check'),
      field('Launcher', this._launcher),
      field('Hosts', this._hosts, 'mk-NewMesh-ssh'),
      field('ssh options', this._sshArgs, 'mk-NewMesh-ssh'),
      field('Nodes', this._nodes, 'mk-NewMesh-slurm'),
      field('Partition', this._partition, 'mk-NewMesh-slurm'),
      field('Time limit', this._time, 'mk-NewMesh-slurm'),
      field('Account', this._account, 'mk-NewMesh-slurm')
    );
    this._launcher.addEventListener('change', () => this._showFields());
    this._showFields();
  }

  getValue(): IRequest {
    return {
      action: 'spawn',
      n: Number(this._n.value) || 1,
      name: this._name.value.trim(),
      detach: this._detach.checked,
      launcher: this._launcher.value,
      hosts: this._hosts.value.trim(),
      ssh_args: this._sshArgs.value.trim(),
      nodes: Number(this._nodes.value) || 1,
      partition: this._partition.value.trim(),
      time: this._time.value.trim(),
      account: this._account.value.trim()
    };
  }

  private _showFields(): void {
    const launcher = this._launcher.value;
    for (const el of Array.from(this.node.querySelectorAll<HTMLElement>('.mk-NewMesh-ssh'))) {
      el.hidden = launcher !== 'ssh';
    }
    for (const el of Array.from(this.node.querySelectorAll<HTMLElement>('.mk-NewMesh-slurm'))) {
      el.hidden = launcher !== 'slurm';
    }
  }

  private _n: HTMLInputElement;
  private _name: HTMLInputElement;
  private _detach: HTMLInputElement;
  private _launcher: HTMLSelectElement;
  private _hosts: HTMLInputElement;
  private _sshArgs: HTMLInputElement;
  private _nodes: HTMLInputElement;
  private _partition: HTMLInputElement;
  private _time: HTMLInputElement;
  private _account: HTMLInputElement;
}
