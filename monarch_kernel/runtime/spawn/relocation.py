"""Relocation: where the dead ranks of a mesh whose host is gone start again (a port on
another live host of the mesh that has room, asked of its agent with the same room check a
spawn makes), and the mesh's reference once they are there.

The launcher restarts them (``Launcher.restart``); the supervision policy tells every process
that may send to them (``Kind.MOVED``).  Nothing here forks a rank or sends a message to one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..wire.payloads import MovedNotice
from .capacity import NoRoom

if TYPE_CHECKING:
    from .agent_link import AgentLink
    from .host_links import HostLinks
    from .owned_mesh import OwnedMesh

Home = tuple["AgentLink", int]  # the live host's link, and a port reserved there


def new_homes(hosts: HostLinks, om: OwnedMesh, ranks: list[int], check: bool) -> dict[int, Home]:
    """Where the dead ``ranks`` of ``om`` whose host is gone start again: a port each on the
    mesh's other live hosts, the one with the fewest of its ranks asked first, each for as
    many as its room check (``check``, ``capacity.py``) lets it hold.  {} when no rank's host
    is gone; ``ConnectionError``, saying why, when they do not all fit (then none moves: the
    restart fails, and an elastic job goes on without them).  Waits for the hosts' answers:
    never on the IO thread, which reads them."""
    links = om.links
    if links is None or om.stopping:
        return {}
    gone = [r for r in ranks if 0 <= r < len(links) and not links[r].alive and r not in om.alive]
    if not gone:
        return {}
    load: dict[str, list] = {}  # live link id -> [link, ranks of this mesh on it]
    for link in links:
        if link.alive:
            load.setdefault(link.id, [link, 0])[1] += 1
    homes: dict[int, Home] = {}
    refused: list[str] = []
    left = list(gone)
    for link, _n in sorted(load.values(), key=lambda x: x[1]):
        want = len(left)
        while want:
            try:
                ports = hosts.reserve([link], want, check)[link.id]
            except NoRoom as e:  # room for fewer: ask for those
                if min(e.shortfall.fits, want - 1) <= 0:
                    refused.append(str(e))
                    break
                want = min(e.shortfall.fits, want - 1)
                continue
            except ConnectionError as e:
                refused.append(str(e))
                break
            for port in ports:
                homes[left.pop(0)] = (link, port)
            break
    if left:
        first = links[left[0]]
        why = (f"no other host of the mesh has room for them: {'; '.join(refused)}" if refused
               else "the mesh has no other live host")
        raise ConnectionError(f"ranks {left} of mesh '{om.ref.name}' cannot be restarted: their host {first.host} "
                              f"is gone ({first.why_gone or 'its agent ended'}), and {why}")
    return homes


def move(om: OwnedMesh, homes: dict[int, Home]) -> list[MovedNotice]:
    """(IO thread, the launcher's) ranks of ``om`` live on other hosts from now on
    (``homes``): the mesh's reference names them there (ranks forked from now on get it) and
    their links are those hosts'.  Returns what every process that may send to them is told."""
    assert om.links is not None
    notices = []
    for r, (link, port) in sorted(homes.items()):
        old, new = om.ref.addresses[r], f"tcp://{link.ip}:{port}"
        om.ref = om.ref.moved(r, new, link.host)
        om.links[r] = link
        notices.append(MovedNotice(om.ref.id, r, old, new, link.host))
    return notices
