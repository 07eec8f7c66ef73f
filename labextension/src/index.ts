/**
 * monarch-kernel's JupyterLab plugins: the Meshes sidebar (with its status bar item,
 * log tabs and New mesh dialog) and the renderer of rank grids.  Only plugin objects
 * live here; widgets and helpers are in their own modules.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Dialog, MainAreaWidget, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { Kernel } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';

import { MeshConnection } from './connection';
import { gridRendererFactory } from './gridRenderer';
import { meshIcon } from './icon';
import { LogView } from './logView';
import { StacksView } from './stacksView';
import { IReply, IRequest } from './messages';
import { MeshPanel } from './meshPanel';
import { NewMeshBody } from './newMeshDialog';
import { MeshStatus } from './statusItem';

const PLUGIN_ID = 'monarch-kernel-panel:meshes';

namespace CommandIDs {
  export const open = 'monarch-kernel:open-meshes';
  export const newMesh = 'monarch-kernel:new-mesh';
}

const meshes: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'The Meshes sidebar: every mesh and rank of the notebook kernel, live, with buttons.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar, ISettingRegistry, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    notebooks: INotebookTracker,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null,
    restorer: ILayoutRestorer | null
  ) => {
    let logLines = 2000;
    const connections = new Map<Kernel.IKernelConnection, MeshConnection>();
    const logs = new Map<string, MainAreaWidget<LogView>>();

    const connectionOf = (nb: NotebookPanel | null): MeshConnection | null => {
      const kernel = nb?.sessionContext.session?.kernel ?? null;
      if (!kernel || kernel.isDisposed) {
        return null;
      }
      let c = connections.get(kernel);
      if (!c) {
        c = new MeshConnection(kernel);
        connections.set(kernel, c);
        kernel.disposed.connect(() => {
          connections.get(kernel)?.dispose();
          connections.delete(kernel);
        });
      }
      return c;
    };

    const showLog = (connection: MeshConnection, mesh: string, rank: number | null) => {
      const key = `${connection.kernel.id}/${mesh}`;
      let widget = logs.get(key);
      if (!widget || widget.isDisposed) {
        const view = new LogView(connection, mesh, rank, logLines);
        widget = new MainAreaWidget({ content: view });
        widget.id = `monarch-log-${connection.kernel.id}-${mesh}`;
        widget.title.label = `Log: ${mesh}`;
        widget.title.icon = meshIcon;
        widget.title.closable = true;
        logs.set(key, widget);
        widget.disposed.connect(() => logs.delete(key));
        app.shell.add(widget, 'main', { mode: 'split-bottom' });
      } else {
        widget.content.setRank(rank);
      }
      app.shell.activateById(widget.id);
    };

    const stacks = new Map<string, MainAreaWidget<StacksView>>();
    const showStacks = (mesh: string, rank: number | null, report: string) => {
      const key = `${mesh}/${rank ?? 'all'}`;
      let widget: MainAreaWidget<StacksView> | undefined = stacks.get(key);
      if (!widget || widget.isDisposed) {
        widget = new MainAreaWidget({ content: new StacksView() });
        widget.id = `monarch-stacks-${mesh}-${rank ?? 'all'}-${Date.now()}`;
        widget.title.label = rank === null ? `Stacks: ${mesh}` : `Stacks: ${mesh} rank ${rank}`;
        widget.title.icon = meshIcon;
        widget.title.closable = true;
        stacks.set(key, widget);
        widget.disposed.connect(() => stacks.delete(key));
        app.shell.add(widget, 'main', { mode: 'split-bottom' });
      }
      const shown = widget;
      shown.content.setReport(report);
      app.shell.activateById(shown.id);
    };

    const newMesh = async (connection: MeshConnection): Promise<IReply | null> => {
      const result = await showDialog<IRequest>({
        title: 'New mesh',
        body: new NewMeshBody(connection.state?.jobs ?? []),
        buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Spawn' })]
      });
      if (!result.button.accept || !result.value) {
        return null;
      }
      const reply = await connection.request(result.value);
      if (!reply.ok) {
        void showDialog({ title: 'New mesh failed', body: reply.message, buttons: [Dialog.okButton()] });
      }
      return reply;
    };

    const panel = new MeshPanel({ showLog, newMesh, showStacks });
    panel.title.icon = meshIcon;
    app.shell.add(panel, 'right', { rank: 900 });
    restorer?.add(panel, panel.id);

    const status = new MeshStatus(() => app.shell.activateById(panel.id));
    statusBar?.registerStatusItem(PLUGIN_ID, { item: status, align: 'left', rank: 50 });

    const follow = () => {
      const c = connectionOf(notebooks.currentWidget);
      panel.setConnection(c);
      status.setConnection(c);
    };
    const watched = new WeakSet<NotebookPanel>();
    notebooks.currentChanged.connect((_, nb) => {
      if (nb && !watched.has(nb)) {
        watched.add(nb);
        nb.sessionContext.kernelChanged.connect(() => {
          if (notebooks.currentWidget === nb) {
            follow();
          }
        });
      }
      follow();
    });
    follow();

    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Meshes panel',
      execute: () => app.shell.activateById(panel.id)
    });
    app.commands.addCommand(CommandIDs.newMesh, {
      label: 'New mesh…',
      isEnabled: () => panel.connection?.state != null,
      execute: () => panel.newMesh()
    });

    if (settingRegistry) {
      settingRegistry.load(PLUGIN_ID).then(
        settings => {
          const read = () => {
            logLines = (settings.get('logLines').composite as number) ?? logLines;
          };
          read();
          settings.changed.connect(read);
        },
        e => console.warn('monarch-kernel panel: settings not loaded', e)
      );
    }
  }
};

const rankGrid: JupyterFrontEndPlugin<void> = {
  id: 'monarch-kernel-panel:rank-grid',
  description: "Lays out several ranks' figures and rich output side by side.",
  autoStart: true,
  requires: [IRenderMimeRegistry],
  activate: (_app: JupyterFrontEnd, rendermime: IRenderMimeRegistry) => {
    rendermime.addFactory(gridRendererFactory(rendermime), 40);
  }
};

export default [meshes, rankGrid];
