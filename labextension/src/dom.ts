/**
 * A tiny element builder for the panel's widgets (no framework): h('td', {class: 'x'}, 'text').
 */

import { LabIcon } from '@jupyterlab/ui-components';

export type Child = Node | string | null | undefined | false;

export function h(
  tag: string,
  attrs: Record<string, string | number | boolean | undefined> = {},
  ...children: Child[]
): HTMLElement {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === false) {
      continue;
    }
    el.setAttribute(key, value === true ? '' : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) {
      continue;
    }
    el.append(typeof child === 'string' ? document.createTextNode(child) : child);
  }
  return el;
}

export function button(
  label: string,
  title: string,
  onClick: () => void,
  attrs: Record<string, string> = {}
): HTMLButtonElement {
  const b = h('button', { class: 'jp-Button mk-Button', title, type: 'button', ...attrs }, label) as HTMLButtonElement;
  b.addEventListener('click', e => {
    e.stopPropagation();
    onClick();
  });
  return b;
}

/** A button that shows only `icon` (its `label` is its accessible name and tooltip too). */
export function iconButton(
  icon: LabIcon,
  label: string,
  title: string,
  onClick: () => void,
  attrs: Record<string, string> = {}
): HTMLButtonElement {
  const b = button('', title, onClick, { 'aria-label': label, ...attrs });
  b.classList.add('mk-IconButton');
  b.append(icon.element({ tag: 'span', className: 'mk-IconButton-icon' }));
  return b;
}
