/**
 * The stacks tab: the text of a mesh's grouped stacks (`%mesh stacks`), as the kernel
 * wrote it, with the time it was taken.  Plain text in a <pre>: nothing from a rank is
 * ever parsed as HTML.
 */

import { Widget } from '@lumino/widgets';

import { h } from './dom';

export class StacksView extends Widget {
  constructor() {
    super();
    this.addClass('mk-Stacks');
    this._when = h('div', { class: 'mk-Stacks-when' });
    this._text = h('pre', { class: 'mk-Stacks-text' });
    this.node.append(this._when, this._text);
  }

  /** Show a new report (the button was pressed again). */
  setReport(report: string): void {
    this._when.textContent = `taken at ${new Date().toLocaleTimeString()}`;
    this._text.textContent = report;
  }

  private _when: HTMLElement;
  private _text: HTMLElement;
}
