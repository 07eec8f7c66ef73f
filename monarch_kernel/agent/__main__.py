"""``python -m monarch_kernel.agent``: read the credentials line, then serve until the
controller goes (see ``host_agent``); with ``--listen ADDR --key-file PATH``, a worker that
waits for controllers holding the key (see ``worker``)."""

from __future__ import annotations

import argparse
import sys

from .host_agent import main

EPILOG = """Without options it is the agent a job's launcher starts (ssh, srun), reading its
credentials on stdin.  With --listen it is a worker that any scheduler starts; a notebook
attaches with  attach_to_workers(workers=["tcp://HOST:PORT", ...], key="PATH")  or
%mesh spawn --attach tcp://HOST:PORT,... --key-file PATH.  Make the key with
python -m monarch_kernel key new PATH  and copy it (mode 0600) to every host."""


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m monarch_kernel.agent", epilog=EPILOG,
                                description="a host's agent, or (--listen) a worker that waits for controllers")
    p.add_argument("--listen", required=True, metavar="tcp://ADDR:PORT",
                   help="where to wait for controllers (ADDR * or 0.0.0.0: every interface; PORT 0: any free one)")
    p.add_argument("--key-file", required=True, metavar="PATH",
                   help="the key controllers must hold (python -m monarch_kernel key new PATH; mode 0600)")
    args = p.parse_args(argv)
    from .worker import run_worker_loop_forever

    try:
        run_worker_loop_forever(address=args.listen, key=args.key_file)
    except (ValueError, OSError) as e:  # a bad address, a key file others can read, a port in use
        print(f"monarch_kernel worker: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]) if sys.argv[1:] else main())
