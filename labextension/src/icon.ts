/** The Meshes sidebar's icon: a 2x2 grid of ranks. */

import { LabIcon } from '@jupyterlab/ui-components';

const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">
<g class="jp-icon3" fill="#616161">
<rect x="1" y="1" width="6" height="6" rx="1"/><rect x="9" y="1" width="6" height="6" rx="1"/>
<rect x="1" y="9" width="6" height="6" rx="1"/><rect x="9" y="9" width="6" height="6" rx="1"/>
</g></svg>`;

export const meshIcon = new LabIcon({ name: 'monarch-kernel:mesh', svgstr });
