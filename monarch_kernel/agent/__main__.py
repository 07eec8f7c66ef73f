"""``python -m monarch_kernel.agent``: read the credentials line, then serve until the
controller goes (see ``host_agent``)."""

from __future__ import annotations

import sys

from .host_agent import main

if __name__ == "__main__":
    sys.exit(main())
