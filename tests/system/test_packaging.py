"""One ``pip install`` gives Jupyter everything: the wheel built from a clean copy of this
tree (no labextension/prebuilt, no compiled TypeScript: what a fresh clone has), installed
into a fresh virtual environment, makes ``jupyter kernelspec list``, ``jupyter labextension
list`` and ``jupyter server extension list`` show the kernel, the Mesh panel and the REST
API; the build ran the panel's production ``jlpm build`` itself, and stops with a message
saying what to install when Node.js is missing.  The fresh environment borrows its
dependencies (torch, Jupyter) from this one through a plain path entry (no download);
monarch_kernel itself comes from the wheel.

The copy takes labextension/node_modules from this checkout when it has one, as hard links:
it is what ``make setup`` left there, ``jlpm install --immutable`` of the committed
yarn.lock, which the build runs again in the copy (it then only checks it); without it the
build installs the packages itself (from yarn's cache, else the registry)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from support.checkout_copy import clean_copy

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
PANEL = "share/jupyter/labextensions/monarch-kernel-panel"


def sh(*cmd, env=None, timeout=240, cwd=ROOT) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd)
    assert p.returncode == 0, (f"{' '.join(map(str, cmd))} exited {p.returncode}:\n"
                               f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout + p.stderr


def pip_wheel(src: Path, out: Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, env=env, timeout=280, cwd=src)


def venv_bin_only() -> dict:
    """This environment with PATH reduced to the interpreter's own scripts: no node there."""
    return dict(os.environ, PATH=sysconfig.get_path("scripts"))


def panel_files(names: list[str]) -> set[str]:
    return {n.split(f"{PANEL}/", 1)[1] for n in names if f"{PANEL}/" in n}


def check_panel(files: set[str]) -> None:
    assert {"package.json", "install.json", "static/style.js"} <= files, sorted(files)
    assert any(f.startswith("static/remoteEntry.") and f.endswith(".js") for f in files), sorted(files)
    for schema in (ROOT / "labextension" / "schema").glob("*.json"):
        assert f"schemas/monarch-kernel-panel/{schema.name}" in files, sorted(files)


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed: the wheel's build needs it "
                    "for the Mesh panel (see README.md)")
@pytest.mark.timeout(480)  # two wheel builds (one with the panel's), an sdist, a venv, three Jupyter apps
def test_the_wheel_installs_the_kernelspec_the_panel_and_the_server_extension(tmp_path):
    tree = clean_copy(tmp_path / "tree")
    built = pip_wheel(tree, tmp_path / "dist")
    assert built.returncode == 0, f"pip wheel exited {built.returncode}:\n{built.stderr[-3000:]}"
    assert (tree / "labextension" / "prebuilt" / "package.json").exists()  # built by the wheel's build
    (wheel,) = (tmp_path / "dist").glob("monarch_kernel-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = [n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n]
    assert "share/jupyter/kernels/monarch/kernel.json" in data
    check_panel(panel_files(names))
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


    # The sdist carries the built panel (and its sources); a wheel built from it, with no
    # node on PATH, carries the panel too.
    sh(sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist"), cwd=tree)
    (sdist,) = (tmp_path / "sdist").glob("monarch_kernel-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
        members = [m.split("/", 1)[1] for m in tar.getnames() if "/" in m]
    assert {"native/wire.c", "native/ibverbs.c", "labextension/src/index.ts", "labextension/yarn.lock",
            "labextension/prebuilt/package.json"} <= set(members), sorted(members)
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    again = pip_wheel(unpacked, tmp_path / "dist2", env=venv_bin_only())
    assert again.returncode == 0, f"pip wheel of the sdist exited {again.returncode}:\n{again.stderr[-3000:]}"
    (wheel2,) = (tmp_path / "dist2").glob("monarch_kernel-*.whl")
    assert panel_files(zipfile.ZipFile(wheel2).namelist()) == panel_files(names)


def test_without_node_the_wheel_build_stops_and_says_what_to_install(tmp_path):
    tree = clean_copy(tmp_path / "tree", node_modules=False)
    built = pip_wheel(tree, tmp_path / "dist", env=venv_bin_only())
    assert built.returncode != 0 and not list((tmp_path / "dist").glob("*.whl"))
    out = " ".join((built.stdout + built.stderr).split())
    assert ("building monarch-kernel builds its Mesh panel (the JupyterLab extension in labextension/), which "
            "needs Node.js, and there is no `node` on PATH: install Node.js 20.19 or newer") in out, out[-3000:]


def test_install_user_still_writes_the_kernelspec(tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    out = sh(sys.executable, "-m", "monarch_kernel", "install", "--user", env=env)
    assert "installed kernelspec 'monarch'" in out
    spec = json.loads((tmp_path / "data" / "kernels" / "monarch" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
