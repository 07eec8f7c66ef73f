"""Builds the optional native extensions (ibverbs, the wire's hot path) and lists the wheel's data files;
everything else is in pyproject.toml.

The extension needs libibverbs' headers (Debian: libibverbs-dev).  Without them the package
installs without it, and ``monarch_kernel.data.transports()`` says so.

Data files, so that ``pip install`` alone gives JupyterLab the kernel, the Mesh panel and
its REST API: the ``monarch`` kernelspec (share/jupyter/kernels/monarch, written here with
``python`` as its interpreter, which jupyter_client resolves to the environment's), the
prebuilt labextension (labextension/prebuilt, from ``jlpm build``; ``make`` builds it) and
the server extension's jupyter_server_config.d file.
"""

import glob
import json
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


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
           "monarch_kernel.runtime._wire": "messages take the pure-Python path",
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
    spec_dir = os.path.join("build", "kernelspec", "monarch")
    os.makedirs(os.path.join(HERE, spec_dir), exist_ok=True)
    with open(os.path.join(HERE, spec_dir, "kernel.json"), "w") as f:
        json.dump(KERNELSPEC, f, indent=1)
    files = [("share/jupyter/kernels/monarch", [os.path.join(spec_dir, "kernel.json")]),
             ("etc/jupyter/jupyter_server_config.d", ["extension/jupyter_server_config.d/monarch_kernel_server.json"])]
    built = os.path.join("labextension", "prebuilt")
    if not os.path.exists(os.path.join(HERE, built, "package.json")):
        print(f"warning: {built} is missing (cd labextension && jlpm install && jlpm build): "
              "the package installs without the Mesh panel")
        return files
    dest = f"share/jupyter/labextensions/{LABEXT_NAME}"
    files.append((dest, [os.path.join(built, "package.json"), os.path.join("labextension", "install.json")]))
    for path in sorted(glob.glob(os.path.join(HERE, built, "**", "*"), recursive=True)):
        rel = os.path.relpath(path, os.path.join(HERE, built))
        if os.path.isfile(path) and os.path.dirname(rel):
            files.append((f"{dest}/{os.path.dirname(rel)}", [os.path.join(built, rel)]))
    return files


EXTENSIONS = []
if HEADERS:
    EXTENSIONS.append(Extension("monarch_kernel.data._ibverbs", ["native/ibverbs.c"], libraries=["ibverbs"],
                                extra_compile_args=["-O2", "-Wall"]))
if SSL_HEADERS:
    EXTENSIONS.append(Extension("monarch_kernel.runtime._wire", ["native/wire.c"], libraries=["crypto", "dl"],
                                extra_compile_args=["-O2", "-Wall"]))

setup(
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": OptionalBuildExt},
    data_files=data_files(),
)
