/**
 * The server extension's REST API (extension/): detached meshes listed with no kernel
 * attached, attached to a kernel, stopped.  Jupyter Server's token and XSRF cookie go
 * with every request (ServerConnection does it).
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IDetachedMesh } from './messages';

async function call(path: string, init: RequestInit = {}): Promise<any> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'monarch', 'meshes', path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  const body = text ? JSON.parse(text) : {};
  if (!response.ok) {
    throw new Error(body.message || `${response.status} ${response.statusText}`);
  }
  return body;
}

export async function listDetached(): Promise<IDetachedMesh[]> {
  const body = await call('');
  return body.meshes as IDetachedMesh[];
}

export async function attachDetached(name: string, kernelId: string): Promise<string> {
  const body = await call(`${encodeURIComponent(name)}/attach`, {
    method: 'POST',
    body: JSON.stringify({ kernel_id: kernelId })
  });
  return body.message as string;
}

export async function stopDetached(name: string): Promise<string> {
  const body = await call(encodeURIComponent(name), { method: 'DELETE' });
  return body.message as string;
}
