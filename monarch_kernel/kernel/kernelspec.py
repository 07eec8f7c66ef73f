"""The ``monarch`` kernelspec and the setup commands of ``monarch-kernel`` (``cli/``):
``install [--user|--sys-prefix]`` installs the kernelspec; ``settings [--markdown]`` prints
the settings in force (or the documentation's tables); ``key new PATH`` writes the key workers
(``agent --listen``) and their controllers share."""

from __future__ import annotations

import json
import os
import sys
import tempfile

KERNEL_NAME = "monarch"
DISPLAY_NAME = "Python 3 (monarch mesh)"


def spec() -> dict:
    return {
        "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "monarch_kernel.kernel", "-f", "{connection_file}"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True},
    }


def install(user: bool = False, prefix: str | None = None) -> str:
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        with open(os.path.join(d, "kernel.json"), "w") as f:
            json.dump(spec(), f, indent=1)
        return KernelSpecManager().install_kernel_spec(d, KERNEL_NAME, user=user, prefix=prefix)


def new_key(path: str) -> int:
    from ..agent import worker_key

    try:
        made = worker_key.new_key_file(path)
    except OSError as e:
        print(f"python -m monarch_kernel key new: {e}", file=sys.stderr)
        return 1
    print(f"wrote a new key to {made} (mode 0600).  Copy it to every worker host, keeping its mode (scp -p), "
          f"and start each worker with  python -m monarch_kernel.agent --listen tcp://0.0.0.0:PORT --key-file {made}")
    return 0


def settings(markdown: bool) -> int:
    from ..runtime import config

    if markdown:
        sys.stdout.write(config.markdown())
        return 0
    for s in config.SETTINGS.values():
        if s.env:
            now = config.value(s)
            print(f"{s.env}={'' if now is None else now}  ({s.help})")
    return 0
