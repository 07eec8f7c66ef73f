"""``python -m monarch_kernel``: ``install [--user|--sys-prefix]`` installs the ``monarch``
kernelspec; ``settings [--markdown]`` prints the settings in force (or the documentation's tables);
``key new PATH`` writes the key workers (``agent --listen``) and their controllers share."""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m monarch_kernel", description="monarch-kernel commands")
    sub = p.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help=f"install the {KERNEL_NAME!r} kernelspec")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only")
    where.add_argument("--sys-prefix", action="store_true", help="into this Python environment")
    where.add_argument("--prefix", help="under this prefix")
    shown = sub.add_parser("settings", help="the settings in force, each with its environment variable")
    shown.add_argument("--markdown", action="store_true", help="the README's tables of settings and constants")
    key = sub.add_parser("key", help="the key that workers (agent --listen) and their controllers share")
    key_sub = key.add_subparsers(dest="key_cmd", required=True)
    key_new = key_sub.add_parser("new", help="write a new key to PATH (mode 0600; never over an existing file)")
    key_new.add_argument("path", metavar="PATH")
    args = p.parse_args(argv)
    if args.cmd == "settings":
        return settings(args.markdown)
    if args.cmd == "key":
        return new_key(args.path)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec {KERNEL_NAME!r} ({DISPLAY_NAME}) in {path}")
    return 0


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
