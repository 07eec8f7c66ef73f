"""The console actor: one persistent namespace per rank, in which ``%%mesh`` cells run.

A cell's last expression is evaluated and its repr returned, as IPython does.  After each
cell the rank writes a sync marker to stdout and stderr, so the controller knows every line
the cell printed has reached it before the cell ends.
"""

from __future__ import annotations

import ast
import linecache
import sys

from ..actor.actor import Actor
from ..actor.endpoint import endpoint

SYNC = "\x1emonarch-sync "


class Console(Actor):
    def __init__(self):
        self.ns: dict = {"__name__": "__mesh__", "__builtins__": __builtins__}

    @endpoint
    def run(self, code: str, filename: str, token: str) -> str | None:
        """Run ``code``; the repr of its last expression, or None."""
        # Let tracebacks on this rank quote the cell's lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), self.ns)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.ns)
                if value is not None:
                    self.ns["_"] = value
                    return repr(value)
            return None
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            print(SYNC + token, flush=True)
            print(SYNC + token, file=sys.stderr, flush=True)

    @endpoint
    def push(self, values: dict) -> None:
        self.ns.update(values)

    @endpoint
    def pull(self, name: str):
        try:
            return self.ns[name]
        except KeyError:
            raise NameError(f"name {name!r} is not defined on this rank") from None
