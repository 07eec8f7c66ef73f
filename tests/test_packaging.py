"""One ``pip install`` gives Jupyter everything: the wheel built from this tree, installed
into a fresh virtual environment, makes ``jupyter kernelspec list``, ``jupyter labextension
list`` and ``jupyter server extension list`` show the kernel, the Mesh panel and the REST
API.  The fresh environment borrows its dependencies (torch, Jupyter) from this one through
a plain path entry (no download); monarch_kernel itself comes from the wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent


def sh(*cmd, env=None, timeout=240, cwd=ROOT) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    assert p.returncode == 0, (f"{' '.join(map(str, cmd))} exited {p.returncode}:\n"
                               f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout + p.stderr


def test_the_wheel_installs_the_kernelspec_the_panel_and_the_server_extension(tmp_path):
    if not (ROOT / "labextension" / "prebuilt" / "package.json").exists():
        pytest.skip("labextension/prebuilt is not built (make builds it: cd labextension && jlpm build)")
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
       str(ROOT))
    (wheel,) = (tmp_path / "dist").glob("monarch_kernel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = [n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n]
    assert "share/jupyter/kernels/monarch/kernel.json" in data
    assert "share/jupyter/labextensions/monarch-kernel-panel/package.json" in data
    assert "etc/jupyter/jupyter_server_config.d/monarch_kernel_server.json" in data
    spec = json.loads(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("kernels/monarch/kernel.json"))))
    from monarch_kernel.kernel.kernelspec import spec as installed_spec

    assert spec == {**installed_spec(), "argv": ["python", *installed_spec()["argv"][1:]]}

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", str(venv))
    py = venv / "bin" / "python"
    sh(str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel))
    fresh_site = sh(str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    Path(fresh_site, "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "PYTHONPATH"))}
    env["PWD"] = str(tmp_path)
    env.update(HOME=str(tmp_path / "home"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"))
    where = sh(str(py), "-c", "import monarch_kernel, monarch_kernel_server; print(monarch_kernel.__file__); "
               "print(monarch_kernel_server.__file__)", env=env, cwd=tmp_path)
    assert where.count(fresh_site) == 2, where  # from the wheel, not this checkout

    def jupyter(app: str, *args: str) -> str:
        """``jupyter SUB ARGS`` in the fresh venv (its own entry points are not installed there)."""
        module, cls = app.rsplit(":", 1)
        return sh(str(py), "-c", f"import sys; from {module} import {cls} as App; sys.argv[1:] = {list(args)!r}; "
                  "App.launch_instance()", env=env, cwd=tmp_path)

    kernels = jupyter("jupyter_client.kernelspecapp:KernelSpecApp", "list", "--json")
    monarch = json.loads(kernels)["kernelspecs"]["monarch"]
    assert monarch["resource_dir"].startswith(str(venv)), monarch
    assert monarch["spec"]["display_name"] == "Python 3 (monarch mesh)"
    labext = jupyter("jupyterlab.labextensions:LabExtensionApp", "list")
    panel = [line for line in labext.splitlines() if "monarch-kernel-panel" in line]
    assert panel and "enabled" in panel[0] and "OK" in panel[0], labext
    server = jupyter("jupyter_server.extension.serverextension:ServerExtensionApp", "list")
    assert "monarch_kernel_server" in server and "enabled" in server, server
    assert "monarch_kernel_server  \x1b[32mOK" in server or "monarch_kernel_server  OK" in server, server


def test_install_user_still_writes_the_kernelspec(tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    out = sh(sys.executable, "-m", "monarch_kernel", "install", "--user", env=env)
    assert "installed kernelspec 'monarch'" in out
    spec = json.loads((tmp_path / "data" / "kernels" / "monarch" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
