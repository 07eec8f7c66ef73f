"""Install the ``monarch`` kernelspec: ``python -m monarch_kernel install [--user|--sys-prefix]``."""

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
    args = p.parse_args(argv)
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install(user=args.user, prefix=prefix)
    print(f"installed kernelspec {KERNEL_NAME!r} ({DISPLAY_NAME}) in {path}")
    return 0
