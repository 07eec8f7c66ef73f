"""Builds the optional native extensions (ibverbs, the wire's hot path) and lists the wheel's data files;
everything else is in pyproject.toml.

The extension needs libibverbs' headers (Debian: libibverbs-dev).  Without them the package
installs without it, and ``monarch_kernel.data.transports()`` says so.

Data files, so that ``pip install`` alone gives JupyterLab the kernel, the Mesh panel and
its REST API: the ``monarch`` kernelspec (share/jupyter/kernels/monarch, written here with
``python`` as its interpreter, which jupyter_client resolves to the environment's), the
labextension (labextension/prebuilt) and the server extension's jupyter_server_config.d file.

The labextension is built here, as JupyterLab's extension template does with its build hook:
a wheel or an sdist built from a checkout first runs the production ``jlpm install --immutable
&& jlpm build`` in labextension/ (``build_labextension``, unless labextension/prebuilt is newer
than every source of it), and the sdist carries the result (MANIFEST.in), so a wheel built
from the sdist needs no Node.js.  Without Node.js the build stops with an error saying what
to install: it never ships a wheel without the panel.  An editable install leaves the panel
to ``make setup``, which builds it and links it into the environment.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Command, Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist
from setuptools.errors import SetupError


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - each part reports its extension is missing
            print(f"warning: the native extensions were not built ({e}); {MISSING.get('*')}")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"warning: {ext.name} was not built ({e}); {MISSING[ext.name]}")


HEADERS = os.path.exists("/usr/include/infiniband/verbs.h")
# The wire's hot path (native/wire.c) needs OpenSSL's headers (Debian: libssl-dev); without
# them messages take the pure-Python path, the same wire format, slower.
SSL_HEADERS = os.path.exists("/usr/include/openssl/sha.h")
MISSING = {"monarch_kernel.data._ibverbs": "the ibverbs transport is off",
           "monarch_kernel.runtime.wire._wire": "messages take the pure-Python path",
           "*": "the ibverbs transport is off and messages take the pure-Python path"}
HERE = os.path.dirname(os.path.abspath(__file__))
LABEXT_NAME = "monarch-kernel-panel"
# The same as monarch_kernel.kernel.kernelspec.spec() but for the interpreter (a test checks it).
KERNELSPEC = {
    "argv": ["python", "-Xfrozen_modules=off", "-m", "monarch_kernel.kernel", "-f", "{connection_file}"],
    "display_name": "Python 3 (monarch mesh)",
    "language": "python",
    "interrupt_mode": "signal",
    "metadata": {"debugger": True},
}


def data_files():
    """The wheel's data files: the kernelspec, the server extension's config and, once it is
    built, the labextension."""
    spec_dir = os.path.join("build", "kernelspec", "monarch")
    os.makedirs(os.path.join(HERE, spec_dir), exist_ok=True)
    with open(os.path.join(HERE, spec_dir, "kernel.json"), "w") as f:
        json.dump(KERNELSPEC, f, indent=1)
    files = [("share/jupyter/kernels/monarch", [os.path.join(spec_dir, "kernel.json")]),
             ("etc/jupyter/jupyter_server_config.d", ["extension/jupyter_server_config.d/monarch_kernel_server.json"])]
    built = os.path.join("labextension", "prebuilt")
    if not os.path.exists(os.path.join(HERE, built, "package.json")):
        return files  # bdist_wheel and sdist build it first (build_labextension)
    dest = f"share/jupyter/labextensions/{LABEXT_NAME}"
    files.append((dest, [os.path.join(built, "package.json"), os.path.join("labextension", "install.json")]))
    for path in sorted(glob.glob(os.path.join(HERE, built, "**", "*"), recursive=True)):
        rel = os.path.relpath(path, os.path.join(HERE, built))
        if os.path.isfile(path) and os.path.dirname(rel):
            files.append((f"{dest}/{os.path.dirname(rel)}", [os.path.join(built, rel)]))
    return files


# ---------------------------------------------------------------- the labextension

LABEXT = os.path.join(HERE, "labextension")
PREBUILT = os.path.join(LABEXT, "prebuilt")
# What the build reads (a change to any makes labextension/prebuilt stale) ...
LABEXT_SOURCES = ("package.json", "yarn.lock", "tsconfig.json", ".yarnrc.yml", "src", "style", "schema")
# ... and what it must leave (checked after the build, as the template's ensured-targets).
LABEXT_TARGETS = ("package.json", "static/style.js", "static/remoteEntry.*.js")
NODE_MIN = (20, 19)  # @rspack/core's minimum: the labextension's bundler
FIX_NODE = (f"install Node.js {NODE_MIN[0]}.{NODE_MIN[1]} or newer (https://nodejs.org, NodeSource's Debian/Ubuntu "
            "packages, or nvm; Debian 12's own nodejs 18 is too old), put it on PATH and build again")


def _labext_built() -> bool:
    return all(glob.glob(os.path.join(PREBUILT, t)) for t in LABEXT_TARGETS)


def _labext_up_to_date() -> bool:
    """Whether labextension/prebuilt is complete and newer than every source of it (in an
    unpacked sdist, complete is enough: it was built from the sources it carries)."""
    if not _labext_built():
        return False
    if os.path.exists(os.path.join(HERE, "PKG-INFO")):
        return True
    newest = 0.0
    for name in LABEXT_SOURCES:
        path = os.path.join(LABEXT, name)
        paths = [path] if os.path.isfile(path) else glob.glob(os.path.join(path, "**", "*"), recursive=True)
        newest = max([newest] + [os.path.getmtime(p) for p in paths if os.path.isfile(p)])
    return os.path.getmtime(os.path.join(PREBUILT, "package.json")) > newest


def _build_env() -> dict:
    """The environment for jlpm: this interpreter's scripts first on PATH (``jlpm build`` runs
    jupyter-builder's command; pip's isolated build environment puts its own there too)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), env.get("PATH", os.defpath)])
    env.setdefault("YARN_ENABLE_TELEMETRY", "0")
    return env


def _check_tools(env: dict) -> None:
    """Stop with the fix unless Node.js (new enough) and jupyter-builder are there."""
    node = shutil.which("node", path=env["PATH"])
    if node is None:
        raise SetupError("building monarch-kernel builds its Mesh panel (the JupyterLab extension in "
                         f"labextension/), which needs Node.js, and there is no `node` on PATH: {FIX_NODE}. "
                         "(A wheel without the panel is never built.)")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, env=env).stdout.strip()
    try:
        version = tuple(int(x) for x in out.lstrip("v").split(".")[:2])
    except ValueError:
        version = (0, 0)
    if version < NODE_MIN:
        raise SetupError(f"building the Mesh panel (labextension/) needs Node.js {NODE_MIN[0]}.{NODE_MIN[1]} or "
                         f"newer, and {node} is {out or 'of an unknown version'}: {FIX_NODE}")
    if shutil.which("jupyter-builder", path=env["PATH"]) is None:
        raise SetupError("building the Mesh panel (labextension/) needs the Python package jupyter-builder (it "
                         "brings jlpm and `jupyter-builder build`), a build requirement in pyproject.toml that "
                         "this environment lacks: build with build isolation (plain `pip install .`), or "
                         "`pip install 'jupyter-builder>=1.3,<2'` before building with --no-build-isolation")


def _jlpm(*args: str, env: dict) -> None:
    cmd = [sys.executable, "-c", "from jupyter_builder.jlpm import main; main()", *args]
    print(f"labextension/: jlpm {' '.join(args)}", flush=True)
    rc = subprocess.call(cmd, cwd=LABEXT, env=env)
    if rc != 0:
        raise SetupError(f"`jlpm {' '.join(args)}` in labextension/ exited {rc} (its output is above), so the "
                         "Mesh panel was not built; fix that and build again (a wheel without the panel is "
                         "never built)")


class build_labextension(Command):  # noqa: N801 - setuptools commands are named so
    description = "build the Mesh panel (labextension/ into labextension/prebuilt) with the production jlpm build"
    user_options: list = []

    def initialize_options(self):
        pass

    def finalize_options(self):
        pass

    def run(self):
        if _labext_up_to_date():
            print("labextension/prebuilt is up to date", flush=True)
        else:
            env = _build_env()
            _check_tools(env)
            _jlpm("install", "--immutable", env=env)
            _jlpm("build", env=env)
            missing = [t for t in LABEXT_TARGETS if not glob.glob(os.path.join(PREBUILT, t))]
            if missing:
                raise SetupError(f"`jlpm build` in labextension/ succeeded but left no prebuilt/{', '.join(missing)}: "
                                 "check labextension/package.json's jupyterlab.outputDir")
            os.utime(os.path.join(PREBUILT, "package.json"))  # newer than every source, as make expects
        # The data files were listed before the build: list them again, panel included.
        self.distribution.data_files[:] = data_files()


class BdistWheelWithPanel(bdist_wheel):
    def run(self):
        self.run_command("build_labextension")
        super().run()


class SdistWithPanel(sdist):
    def run(self):
        self.run_command("build_labextension")
        super().run()


EXTENSIONS = []
if HEADERS:
    EXTENSIONS.append(Extension("monarch_kernel.data._ibverbs", ["native/ibverbs.c"], libraries=["ibverbs"],
                                extra_compile_args=["-O2", "-Wall"]))
if SSL_HEADERS:
    EXTENSIONS.append(Extension("monarch_kernel.runtime.wire._wire", ["native/wire.c"], libraries=["crypto", "dl"],
                                extra_compile_args=["-O2", "-Wall"]))

setup(
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": OptionalBuildExt, "build_labextension": build_labextension,
              "bdist_wheel": BdistWheelWithPanel, "sdist": SdistWithPanel},
    data_files=data_files(),
)
