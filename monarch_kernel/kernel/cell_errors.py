"""How a ``%%mesh`` cell's failures show in the notebook.

- A failure that is the same on several ranks (same type, message and frames) shows once,
  ``[ranks 0-3] ZeroDivisionError: division by zero`` and one traceback; different failures
  show one group each, in rank order.
- The stop button shows one line per place the ranks were interrupted, and none of the
  kernel's own frames.
- A syntax error is found here, before the cell is sent: the cell is transformed as IPython
  transforms it (``!ls``, ``%timeit`` pass) and compiled under the file name and line numbers
  the ranks would use.

The exception raised carries the type name of the first failure, since ipykernel's ``error``
reply names an exception by its class: ``ename`` is then ``ZeroDivisionError``, not a name of
ours.  Runs in the kernel.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import traceback
from dataclasses import dataclass, field

from ..runtime import rank_label

_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def clean_traceback(text: str) -> str:
    """Drop the console's own frames (console/) from a rank's traceback."""
    out, skip = [], False
    for line in text.splitlines():
        if line.startswith("  File "):
            skip = "monarch_kernel" in line and ("console.py" in line or "/console/" in line)
        elif not line.startswith("    "):
            skip = False
        if not skip:
            out.append(line)
    return "\n".join(out)


def name_cells(text: str, label=None) -> str:
    """A traceback's frames in notebook cells named as IPython names them: ``Cell In[7], line
    4`` (``, in f`` inside a function), not the file ipykernel compiled the cell under;
    ``label``: file name -> ``Cell In[7]`` or None (default: the running IPython's names)."""
    label = label or cell_label
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        named = label(m["file"]) if m else None
        if m is None or not named:
            out.append(line)
            continue
        out.append(f"  {named}, line {m['line']}" + (f", in {m['func']}" if m["func"] != "<module>" else ""))
        quoted = i + 1 < len(lines) and lines[i + 1].startswith("    ")
        source = "" if quoted else linecache.getline(m["file"], int(m["line"])).strip()
        if source:  # a cell of the notebook's own, whose text the rank had not: quoted from here
            out.append(f"    {source}")
    return "\n".join(out)


def cell_label(filename: str) -> str | None:
    """``Cell In[7]`` for the file the running IPython compiled cell 7 under; None for others."""
    from IPython import get_ipython

    shell = get_ipython()
    fmt = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = fmt(filename) if fmt is not None else None
    return " ".join(named) if named else None


@dataclass
class Failure:
    """One failure, and every rank that failed that way."""

    type_name: str
    message: str
    text: str  # the traceback as shown (console frames dropped), or the error's own text
    ranks: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, err: BaseException) -> Failure:
        remote = getattr(err, "failure", None)  # an ActorError's record of what the rank raised
        type_name = getattr(remote, "type_name", "") or type(err).__name__
        message = getattr(remote, "message", None)
        tb = getattr(err, "remote_traceback", "")
        return cls(type_name, str(err) if message is None else message,
                   name_cells(clean_traceback(tb)) if tb else str(err))

    def headline(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{rank_label(self.ranks)} {self.type_name}{': ' + first if first else ''}"


def group(errors: dict[int, BaseException]) -> list[Failure]:
    """The failures of ``errors`` (rank -> exception), the same ones together, in the order of
    their first rank."""
    groups: dict[tuple[str, str, str], Failure] = {}
    for r in sorted(errors):
        f = Failure.of(errors[r])
        groups.setdefault((f.type_name, f.message, f.text), f).ranks.append(r)
    return list(groups.values())


def render(errors: dict[int, BaseException], cell_file: str, say_interrupt: bool = True) -> list[str]:
    """Ranks that were interrupted: one line per place (``say_interrupt``: saying so); every
    other failure once per group, with its traceback."""
    places: dict[str, list[int]] = {}
    others = {}
    for r, err in sorted(errors.items()):
        if Failure.of(err).type_name == "KeyboardInterrupt":
            places.setdefault(where(getattr(err, "remote_traceback", ""), cell_file), []).append(r)
        else:
            others[r] = err
    kind = "KeyboardInterrupt: " if say_interrupt else ""
    lines = [f"{rank_label(rs)} {kind}{place}" for place, rs in places.items()]
    return lines + [f"{g.headline()}\n{g.text}" for g in group(others)]


_NAMED: dict[tuple[type, str], type] = {}


def named(base: type, type_name: str) -> type:
    """A subclass of ``base`` called ``type_name`` (a rank's exception type), so the cell's
    error reply names that type; made once per name."""
    name = type_name.rpartition(".")[2]
    if not name.isidentifier():
        return base
    key = (base, name)
    if key not in _NAMED:
        _NAMED[key] = type(name, (base,), {"__module__": base.__module__, "__doc__": base.__doc__})
    return _NAMED[key]


class MeshCellError(Exception):
    """A ``%%mesh`` cell failed on some ranks; shows each failure once, with the ranks it
    happened on and its traceback (the cell's lines, not the console's), and a rank that was
    interrupted (the Mesh panel's button) as where it was."""

    def __init__(self, errors: dict[int, BaseException], cell_file: str = ""):
        self.errors, self.cell_file = errors, cell_file
        first = group(errors)[0]
        super().__init__(first.message)
        self.__cause__ = errors[first.ranks[0]]

    @classmethod
    def of(cls, errors: dict[int, BaseException], cell_file: str = "") -> MeshCellError:
        """The error to raise: named after the first failure's type."""
        return named(cls, group(errors)[0].type_name)(errors, cell_file)

    def _render_traceback_(self) -> list[str]:
        return render(self.errors, self.cell_file)


class MeshCellInterrupted(KeyboardInterrupt):
    """The stop button interrupted a ``%%mesh`` cell: one line per place the ranks were
    interrupted, then any other failure; the ranks keep their namespaces."""

    def __init__(self, ranks: list[int], errors: dict[int, BaseException], cell_file: str, late: str = ""):
        self.errors, self.cell_file = errors, cell_file
        kept = "their namespaces are kept" if len(ranks) > 1 else "its namespace is kept"
        super().__init__(f"interrupted on {rank_label(ranks, brackets=False)}; {kept}{late}")

    @classmethod
    def of(cls, ranks: list[int], errors: dict[int, BaseException], cell_file: str,
           late: str = "") -> MeshCellInterrupted:
        """The error to raise: named ``KeyboardInterrupt``, as the cell's reply says."""
        return named(cls, "KeyboardInterrupt")(ranks, errors, cell_file, late)

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}", *render(self.errors, self.cell_file, say_interrupt=False)]


@dataclass
class _Frame:
    file: str
    line: int
    func: str
    source: str


def _frames(text: str) -> list[_Frame]:
    out: list[_Frame] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            source = nxt.strip() if nxt.startswith("    ") and not _FRAME.match(nxt) else ""
            out.append(_Frame(m["file"], int(m["line"]), m["func"], source))
    return out


def where(remote_traceback: str, cell_file: str) -> str:
    """Where a rank was interrupted, from its traceback: ``interrupted at cell line 5:
    time.sleep(1)``; code outside the cell says which cell line called it."""
    # The runtime's own frames (its SIGINT handler is the innermost) say nothing of the user's code.
    frames = [f for f in _frames(remote_traceback) if f"{os.sep}monarch_kernel{os.sep}" not in f.file]
    if not frames:
        return "interrupted"
    inner = frames[-1]
    if inner.file == cell_file:
        at = f"cell line {inner.line}" + (f" in {inner.func}" if inner.func != "<module>" else "")
    else:
        at = f"{inner.file}:{inner.line} in {inner.func}"
    text = f"interrupted at {at}" + (f": {inner.source}" if inner.source else "")
    called = [f for f in frames if f.file == cell_file]
    if called and called[-1] is not inner:
        text += f" (from cell line {called[-1].line})"
    return text


# ---------------------------------------------------------------- syntax, before sending


class CellSyntaxError(Exception):
    """The cell does not compile: shown once, as IPython shows a plain cell's syntax error
    (``Cell In[7], line 3``), and never sent to the ranks."""

    def __init__(self, error: SyntaxError, label: str = ""):
        self.error, self.label = error, label
        super().__init__(str(error))

    def _render_traceback_(self) -> list[str]:
        lines = traceback.format_exception_only(type(self.error), self.error)
        if self.label and lines and lines[0].startswith("  File "):
            lines[0] = f"  {self.label}, line {self.error.lineno}\n"
        return "".join(lines).rstrip("\n").splitlines()


_transformer = None


def _transform(code: str) -> str:
    """``code`` as IPython reads it: the kernel's own shell's ``transform_cell`` where there is
    one (a one-line cell also goes through its prefilter, so ``cd /tmp`` is a magic, as the
    ranks read it), else IPython's input transformers alone."""
    global _transformer
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        return shell.transform_cell(code)
    if _transformer is None:
        from IPython.core.inputtransformer2 import TransformerManager

        _transformer = TransformerManager()
    return _transformer.transform_cell(code)


def check_syntax(code: str, filename: str, line_offset: int, label: str = "") -> None:
    """Raise ``CellSyntaxError`` (named after the SyntaxError's type) if the cell body ``code``
    does not compile as an IPython cell under ``filename``, ``line_offset`` lines into the
    cell; ``label`` names the cell in the message (``Cell In[7]``)."""
    source = "\n" * line_offset + _transform(code)
    try:
        compile(source, filename, "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as e:
        lines = source.splitlines()
        if e.text is None and e.lineno and 0 < e.lineno <= len(lines):  # found by the compiler, not the parser
            e.text = lines[e.lineno - 1] + "\n"
        raise named(CellSyntaxError, type(e).__name__)(e, label) from None
