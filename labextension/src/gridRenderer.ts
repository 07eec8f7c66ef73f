/**
 * The renderer of rank grids: figures and rich output that several ranks of one %%mesh
 * cell displayed, side by side under their rank labels.  Each item is drawn by the
 * notebook's own renderers (images, HTML, ...), so nothing is rendered here by hand.
 */

import { IRenderMime, IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { Panel, Widget } from '@lumino/widgets';

import { h } from './dom';
import { GRID_MIME } from './messages';

interface IGridItem {
  rank: number;
  data: Record<string, unknown>;
  metadata: Record<string, unknown>;
}

export class RankGridRenderer extends Panel implements IRenderMime.IRenderer {
  constructor(options: IRenderMime.IRendererOptions, registry: IRenderMimeRegistry) {
    super();
    this._registry = registry;
    this._mimeType = options.mimeType;
    this.addClass('mk-RankGridOutput');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const value = model.data[this._mimeType] as { items?: IGridItem[] } | undefined;
    const items = value?.items ?? [];
    for (const child of [...this.widgets]) {
      child.dispose();
    }
    for (const item of items) {
      const cell = new Panel();
      cell.addClass('mk-RankGridOutput-cell');
      cell.node.dataset.rank = String(item.rank);
      cell.addWidget(new Widget({ node: h('div', { class: 'mk-RankGridOutput-label' }, `[rank ${item.rank}]`) }));
      this.addWidget(cell);
      const mime = this._registry.preferredMimeType(item.data as any, model.trusted ? 'any' : 'ensure');
      if (!mime || mime === GRID_MIME) {
        continue;
      }
      const renderer = this._registry.createRenderer(mime);
      const inner = this._registry.createModel({
        data: item.data as any,
        metadata: item.metadata as any,
        trusted: model.trusted
      });
      await renderer.renderModel(inner);
      cell.addWidget(renderer);
    }
  }

  private _registry: IRenderMimeRegistry;
  private _mimeType: string;
}

export function gridRendererFactory(registry: IRenderMimeRegistry): IRenderMime.IRendererFactory {
  return {
    safe: true,
    mimeTypes: [GRID_MIME],
    defaultRank: 40,
    createRenderer: options => new RankGridRenderer(options, registry)
  };
}
