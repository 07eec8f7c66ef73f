"""``SPMDActor``: on each rank, torchrun's environment, the process group and the device
mesh, and Monarch's ``main(master_addr, master_port, script_args)`` to run a torchrun script.

Runs on ranks.  Spawned by ``setup_torch_elastic_env`` (with the layout the controller
computed from the mesh's hosts) or by the user (then the layout follows Monarch's rule:
the last dim is the ranks of one host).  Nothing here imports torch until a group is asked for.
"""

from __future__ import annotations

import os
import socket
import sys

from ...actor.actor import Actor, context, current_rank
from ...actor.endpoint import endpoint
from ...runtime import config, gpus
from ..layout import RankEnv, elastic_layout, layout_from_point
from . import flight, group, master_store, profiler
from .script import run_script


class SPMDActor(Actor):
    """Sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
    GROUP_WORLD_SIZE, ROLE_*, MASTER_ADDR, MASTER_PORT) and runs torchrun scripts, as
    Monarch's ``monarch.spmd.SPMDActor``::

        spmd = procs.spawn("spmd", SPMDActor)
        addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get()
        spmd.main.call(addr, port, ["train.py", "--lr", "0.1"]).get()

    ``layout``: ``{proc-mesh rank: RankEnv}`` (``setup_torch_elastic_env`` passes one).
    Without it, called on its whole mesh, it counts local ranks per host from the mesh's
    host names; called on a slice, it follows Monarch's rule (the last dim is one host's).
    It asks for the rank's main thread, so that ``procs.interrupt(spmd)`` cuts a running
    script short; in a notebook the console has it.
    """

    runs_on_main_thread = True

    def __init__(self, layout: dict | None = None):
        self.layout = dict(layout or {})
        self.master: tuple[str, int] | None = None  # the rendezvous setup_env last gave this rank

    def _env(self) -> RankEnv:
        me = current_rank().rank
        mine = self.layout.get(me)
        if mine is not None:
            return mine
        ctx = context()
        p, ref = ctx.message_rank, ctx.actor_instance.mesh  # the point the call went to (a slice's own)
        if ref is not None and ref.hosts and tuple(p.extent.items()) == tuple(ref.dims):
            return elastic_layout(range(ref.size), ref.hosts)[me]  # the whole mesh: count ranks per host
        return layout_from_point(p.coords, p.extent.sizes)

    def _setup_env(self, master_addr: str, master_port: int) -> RankEnv:
        env = self._env()
        if env.rank == 0:  # the store every rank's init_process_group() meets at, as torchrun's agent serves it
            master_store.serve(str(master_addr), int(master_port))
        # Every variable torchrun would set, from this package alone: a rank's environment
        # from its start holds none of them (the runtime knows nothing of torch).
        os.environ.update(env.variables(master_addr, master_port))
        flight.enable(os.environ)  # torch's collectives recorder, for the groups made from here on
        self.master = (str(master_addr), int(master_port))
        if env.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # torchrun's default for several ranks per host; torch reads it at import.
            os.environ["OMP_NUM_THREADS"] = "1"
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
        return env

    @endpoint
    def get_host_port(self, use_ipaddr=None) -> tuple[str, int]:
        """A rendezvous address on this rank's host and a free port there (Monarch's):
        the host's name, or with ``use_ipaddr`` its address (``MONARCH_KERNEL_BIND`` on a
        job's host, else what the name resolves to)."""
        host = socket.gethostname()
        if use_ipaddr:
            host = config.bind_address() or _resolve(host)
        return host, _free_port(host if use_ipaddr else "")

    @endpoint
    def rendezvous(self, spans_hosts: bool, peer: str | None = None) -> tuple[str, int]:
        """Serve torch.distributed's rendezvous store (``master_store``) where the other
        ranks reach this one, on that address alone: 127.0.0.1 when every rank is on this
        host; else this host's bind address (``MONARCH_KERNEL_BIND``), or the address its
        route to ``peer`` leaves from.  Returns ``(MASTER_ADDR, MASTER_PORT)``."""
        if not spans_hosts:
            addr = "127.0.0.1"
        else:
            addr = config.bind_address() or _route_to(peer) or _resolve(socket.gethostname())
        return addr, master_store.serve(addr)

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> None:
        """Set torchrun's variables in this rank's process."""
        self._setup_env(master_addr, master_port)

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        """Set torchrun's variables and run ``script_args`` (a script path or ``-m module``,
        then its arguments) as ``__main__``; True once it returns."""
        self._setup_env(master_addr, master_port)
        return run_script(script_args)

    @endpoint
    def device(self) -> str | None:
        """The GPU this rank's group would use (``runtime.gpus.device_of``), or None."""
        return gpus.device_of(self._env().local_rank)

    @endpoint
    def init_process_group(self, backend: str, timeout_s: float | None = None) -> str:
        """(Re)build the default process group over the mesh; the backend it got."""
        if self.master is None:
            raise RuntimeError("this rank has no rendezvous yet: call  setup_torch_elastic_env(procs)  in the "
                               "controller (or this actor's setup_env.call(addr, port)) before making a group")
        return group.init_group(backend, self._env(), timeout_s)

    @endpoint
    def init_device_mesh(self, device_type: str, shape: tuple, names: tuple) -> tuple:
        return group.build_device_mesh(device_type, shape, names)

    @endpoint
    def collectives(self, last: int = 4) -> dict:
        """This rank's recent collectives per group (``%mesh collectives``)."""
        return flight.snapshot(last)

    @endpoint
    def profile_start(self, cuda: bool | None = None) -> bool:
        return profiler.start(cuda)

    @endpoint
    def profile_stop(self) -> dict:
        return profiler.stop()

    @endpoint
    def clock(self) -> int:
        return profiler.clock()

    @endpoint
    def abort(self, reason: str = "") -> bool:
        """Abort this rank's process group, so what blocks on it fails now."""
        return group.abort_group(reason)


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr and addr != "localhost" else "", 0))
        return s.getsockname()[1]


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _route_to(peer: str | None) -> str | None:
    """The local address this host's route to ``peer`` leaves from (no packet is sent)."""
    if not peer:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


class ElasticEnvActor(SPMDActor):
    """The ``SPMDActor`` that ``setup_torch_elastic_env`` spawns: it keeps to a thread of its
    own, leaving the rank's main thread to the user's actors (or the notebook console), and
    stays idle between set-ups, so it can abort a group that another thread is blocked on."""

    runs_on_main_thread = False
