"""Rank specs: the one grammar for naming ranks in text (``%%mesh --ranks``, the
``(mesh pdb)`` prompt), the one way to label a group of ranks in output, and the one way
to count things in a sentence (``1 rank``, ``4 ranks``, ``1 group``).

Pure functions; they know nothing of processes.

>>> parse_ranks("0-2,5", 8)
[0, 1, 2, 5]
>>> parse_ranks("::2", 5)
[0, 2, 4]
>>> rank_label([0, 1, 2, 5])
'[ranks 0-2,5]'
>>> rank_label([3], brackets=False)
'rank 3'
>>> counted(1, "group"), counted(4, "rank"), counted(2, "mesh", "meshes")
('1 group', '4 ranks', '2 meshes')
"""

from __future__ import annotations

SPEC_HELP = "write ranks like 0, 0-3, 0,2 or ::2"


class RankSpecError(ValueError):
    """A rank spec that does not parse, or names ranks the mesh does not have."""


def parse_ranks(spec: str, n: int) -> list[int]:
    """``0``, ``0-3``, ``0,2``, ``::2`` (and combinations, comma-separated) -> the sorted
    ranks within ``range(n)``; raises ``RankSpecError`` saying what to write instead."""
    out: list[int] = []
    for piece in str(spec).split(","):
        piece = piece.strip()
        try:
            if ":" in piece:
                parts = [int(p) if p else None for p in piece.split(":")]
                if len(parts) > 3:
                    raise ValueError(piece)
                out.extend(range(n)[slice(*parts)])
            elif "-" in piece.lstrip("-"):
                a, b = (int(p) for p in piece.split("-", 1))
                out.extend(range(a, b + 1))
            else:
                out.append(int(piece))
        except ValueError:
            raise RankSpecError(f"{spec!r}: {SPEC_HELP}") from None
    bad = [r for r in out if not 0 <= r < n]
    if bad or not out:
        raise RankSpecError(f"{spec!r}: the mesh has ranks 0-{n - 1}" if n else f"{spec!r}: the mesh has no ranks")
    return sorted(set(out))


def rank_label(ranks, *, brackets: bool = True) -> str:
    """``[rank 3]`` or ``[ranks 0-3,5]``: the label of a group of ranks in output; without
    ``brackets``, ``rank 3`` or ``ranks 0-3,5``, for sentences."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"[rank {ranks[0]}]" if brackets else f"rank {ranks[0]}"
    spans, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(f"{start}-{prev}" if prev > start else f"{start}")
        if r is not None:
            start = prev = r
    label = f"ranks {','.join(spans)}"
    return f"[{label}]" if brackets else label


def counted(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 rank``, ``4 ranks`` (``nouns``: the plural when it is not ``noun + "s"``)."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
