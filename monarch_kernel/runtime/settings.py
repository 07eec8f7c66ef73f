"""Every setting of monarch-kernel and every timing constant of its code, declared once.

Each is a ``Setting`` in ``SETTINGS``: its name in code, its environment variable (or None for
a constant of the code), type, default and meaning.  Only declarations: how a value in force
is read, or given for a process, is ``config.py``'s.  The lowest layer: it imports nothing of
the project.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One setting: ``name`` in code (and on ``MeshKernel``), its environment variable (None:
    a constant of the code), its type, default and meaning; ``unit`` of its value; ``kernel``:
    also a ``MeshKernel`` traitlet; ``minimum``: a smaller value is raised to it; ``shown``:
    the default as the documentation says it; ``used_in``: the module of a constant."""

    name: str
    type: type
    default: Any
    help: str
    env: str | None = None
    unit: str = ""
    kernel: bool = False
    minimum: float | None = None
    shown: str = ""
    used_in: str = ""

    def parse(self, raw: str) -> Any:
        """The value of the environment variable's text (its own ValueError if it is not one)."""
        if self.type is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if self.type is str:
            return raw or None
        value = self.type(raw)
        return value if self.minimum is None else max(self.type(self.minimum), value)

    def default_text(self) -> str:
        """The default as the documentation and ``--help-all`` say it."""
        return self.shown or (f"{self.default:g}" if isinstance(self.default, float) else str(self.default))


def _env(env, name, type_, default, *, help_, unit="", kernel=False, minimum=None, shown=""):
    return Setting(name, type_, default, help_, env, unit, kernel, minimum, shown)


def _s(name, value, used_in, help_):
    return Setting(name, float, value, help_, unit="s", used_in=used_in)


SETTINGS: dict[str, Setting] = {s.name: s for s in [
    # -------------------------------------------- settings (environment; kernel ones also traitlets)
    _env("MONARCH_KERNEL_FANOUT", "fanout", int, 8, kernel=True, minimum=1,
         help_="children per node of the multicast tree"),
    _env("MONARCH_KERNEL_SPAWN_TIMEOUT", "spawn_timeout", float, 60.0, unit="s", kernel=True,
         help_="seconds to wait for ranks to connect"),
    _env("MONARCH_KERNEL_CHECK_LIMITS", "check_limits", bool, True, kernel=True, shown="on",
         help_="`spawn_procs` refuses, before it starts anything, more ranks than a host holds: its free memory "
               "at `rank_memory` a rank, its process limits (RLIMIT_NPROC, pid_max, threads-max, a cgroup's "
               "pids.max) and the controller's open-files limit.  `0`: no such check (for one spawn: "
               "`spawn_procs(..., check_limits=False)`); more than 4,194,304 ranks on one host are refused always"),
    _env("MONARCH_KERNEL_RANK_MEMORY", "rank_memory", int, 8 << 20, unit="bytes", kernel=True, minimum=0,
         shown="8 MiB", help_="memory `spawn_procs` counts per rank against a host's free memory: an idle rank "
                              "measured 6.7-7.1 MiB of its own (USS) and about 0.5 MiB of the kernel's (page "
                              "tables, 5 thread stacks, sockets); raise it for ranks that load more (one that "
                              "imported torch: about 230 MiB), `0` skips the memory check"),
    _env("MONARCH_KERNEL_HEARTBEAT_TIMEOUT", "heartbeat_timeout", float, 10.0, unit="s", kernel=True,
         help_='seconds without a heartbeat after which a rank shows "not responding" (ranks beat every '
               '`rank_beat`)'),
    _env("MONARCH_KERNEL_MAX_FRAME", "max_frame", int, 16 << 30, unit="bytes", kernel=True, shown="16 GiB",
         help_="largest frame a process accepts, in bytes"),
    _env("MONARCH_KERNEL_MAX_WIRE_FRAME", "max_wire_frame", int, 256 << 20, unit="bytes", minimum=256 << 20,
         shown="256 MiB", help_="largest ZeroMQ frame an inbox reads: ZeroMQ refuses a longer one as soon as it "
                                "reads its length, before buffering it, and drops that connection.  Larger values "
                                "travel in 256 MiB pieces, so this never limits what a call carries (at least "
                                "256 MiB)"),
    _env("MONARCH_KERNEL_MAX_LINE", "max_line", int, 1 << 20, unit="bytes", kernel=True, minimum=1024,
         shown="1 MiB", help_="longest piece of one output line the controller holds; longer lines arrive as "
                              "pieces of this size"),
    _env("MONARCH_KERNEL_DATAGRAMS", "datagrams", bool, True, shown="on",
         help_="messages between processes of one host travel over unix datagram sockets, one system call "
               "each way, rather than through ZeroMQ's I/O threads (off: ZeroMQ's ipc, as across hosts)"),
    _env("MONARCH_KERNEL_UNFINISHED_TIMEOUT", "unfinished_timeout", float, 120.0, unit="s", minimum=0.01,
         help_="seconds a same-host message that comes in pieces may wait for its next piece, counted from when "
               "its inbox was last read to the end, before what came of it is dropped (read when an inbox is "
               "made)"),
    _env("MONARCH_KERNEL_UNFINISHED_MEMORY", "unfinished_memory", int, 64 << 20, unit="bytes", minimum=1 << 20,
         shown="64 MiB", help_="bytes a process holds of same-host messages whose pieces have not all come; past "
                               "it the one fed least recently is dropped (one message alone may be larger); raise it "
                               "when several larger messages reach one process at once (read when an inbox is made)"),
    _env("MONARCH_KERNEL_SEND_QUEUE", "send_queue", int, 1000, unit="messages", kernel=True, minimum=1,
         help_="messages one thread may queue for a peer that is not reading before sends to it wait, then fail"),
    _env("MONARCH_KERNEL_SEND_BLOCK", "send_block", float, 5.0, unit="s", kernel=True,
         help_="seconds a caller waits for room in a full queue before `SendFailed` (the IO thread never waits)"),
    _env("MONARCH_KERNEL_RELAY_CONNECTIONS", "relay_connections", int, 256, unit="connections", minimum=1,
         help_="`SlurmJob(login=...)`: connections the login node's relay joins at once (one thread); more are closed"),
    _env("MONARCH_KERNEL_BIND", "bind_address", str, None, kernel=True, shown="the route to the controller",
         help_="the address a process of a job that spans hosts listens on (its inboxes, its data server); an "
               "agent sets it for the ranks it forks"),
    _env("MONARCH_KERNEL_REACH_TIMEOUT", "reach_timeout", float, 5.0, unit="s", kernel=True, minimum=0.1,
         help_="`SSHJob(out_of_cluster=None)`, the default: seconds a host's agent has to connect to the "
               "controller once it dials (its start does not count) before the job ends it and starts it "
               "again with its connections through its ssh connection (`out_of_cluster=True`)"),
    _env("MONARCH_KERNEL_CONTROLLER_VIA", "controller_via", str, None, shown="unset",
         help_="on a host out of the controller's reach (`SSHJob(out_of_cluster=True)` sets it for the agent it "
               "starts): the controller's IP, whose ports this host's ssh connection forwards to its loopback; "
               "`IP@RELAY` (`SlurmJob(login=...)`): a relay on the login node RELAY listens at the same ports"),
    _env("MONARCH_KERNEL_STRICT", "strict", bool, False, kernel=True, shown="off",
         help_="`1`: Monarch's behaviour where ours differs (exit on an unhandled failure, no mixed sync/async "
               "endpoints)"),
    _env("MONARCH_KERNEL_NATIVE_WIRE", "native_wire", bool, True, shown="on (when built)",
         help_="`0`: sign, check and frame messages in pure Python even where the C extension "
               "(`native/wire.c`) is built (same wire format; slower)"),
    _env("MONARCH_KERNEL_DATA_TRANSPORT", "data_transport", str, None, shown="best per pair",
         help_="force one data-plane transport (`shm`, `tcp`, `ibverbs` or `cuda_ipc`) instead of the best "
               "usable one per pair of ranks"),
    _env("MONARCH_KERNEL_DATA_BIND", "data_bind", str, None,
         shown="127.0.0.1 on one host; the namespace's addresses across hosts",
         help_="address(es) data servers listen on (comma-separated; `0.0.0.0` for all)"),
    _env("MONARCH_KERNEL_DATA_HANDSHAKE_TIMEOUT", "data_handshake_timeout", float, 5.0, unit="s", minimum=0.01,
         help_="seconds a data connection has, in all, to prove it holds the job key (read when the server "
               "starts)"),
    _env("MONARCH_KERNEL_TCP_STREAMS", "tcp_streams", int, 2, minimum=1,
         help_="connections one `tcp` transfer of 8 MiB or more is split over (two measured 40-80% faster "
               "than one on a 2-core loopback; three slower than two)"),
    _env("MONARCH_KERNEL_DATA_COPY_THREADS", "data_copy_threads", int, min(8, os.cpu_count() or 1), minimum=1,
         shown="the cores, at most 8",
         help_="threads one `shm` copy of 16 MiB or more is split over (each part 4 MiB or more); the copy "
               "of one thread reaches a fraction of a many-core host's memory bandwidth"),
    _env("MONARCH_KERNEL_NETNS", "netns", str, None, shown="none",
         help_="network namespace (a name under /run/netns, or a path) ranks enter before they start, to "
               "place them on separate simulated hosts"),
    _env("MONARCH_KERNEL_STACKS_PY_SPY", "stacks_py_spy", bool, True, kernel=True,
         help_="`%mesh stacks` may run py-spy (from each rank's template or agent) on ranks that do not dump "
         "their own stacks in time; off: only the ranks' own dumps"),
    _env("MONARCH_KERNEL_HISTORY", "record_history", bool, True, kernel=True, shown="on",
         help_="every host writes its meshes' history (ranks' lines, lifecycle events, metrics, samples) as "
               "Parquet files under `history_dir`, to query in SQL (`%mesh history`); `0`: none is written"),
    _env("MONARCH_KERNEL_HISTORY_DIR", "history_dir", str, None, kernel=True,
         shown="$XDG_STATE_HOME/monarch-kernel/history (~/.local/state/...)",
         help_="where histories live, one folder (0700) per mesh or job and host under it; point it at a shared "
               "file system to read every host's history from anywhere"),
    _env("MONARCH_KERNEL_HISTORY_MAX_BYTES", "history_max_bytes", int, 1 << 30, unit="bytes", kernel=True,
         minimum=1 << 20, shown="1 GiB",
         help_="history kept per host, all meshes together: past it the oldest files go first, and the drop is "
               "recorded as a `history_dropped` event"),
    _env("MONARCH_KERNEL_HISTORY_FLUSH", "history_flush", float, 2.0, unit="s", minimum=0.05,
         help_="how often a host writes the history rows it has gathered (a batch is also written at 100,000 rows)"),
    _env("MONARCH_KERNEL_HISTORY_RUN", "history_run", str, None, shown="none",
         help_="the run (one spawn of a mesh) a job's host writes a mesh's history under: a controller gives it "
               "to each spawn on other hosts, so that every host of the run writes into one folder; not to be set "
               "by hand"),
    _env("MONARCH_KERNEL_HISTORY_SAMPLE", "history_sample", float, 10.0, unit="s", kernel=True, minimum=0.0,
         help_="how often a controller records each rank's CPU and memory (the figures of `%mesh top`) into "
               "the history; `0`: only when `%mesh top` samples"),
    _env("MONARCH_KERNEL_IB_DEVICE", "ib_device", str, None, shown="the first", help_="RDMA device for `ibverbs`"),
    _env("MONARCH_KERNEL_IB_PORT", "ib_port", int, 1, help_="port of the RDMA device for `ibverbs`"),
    _env("MONARCH_KERNEL_IB_GID_INDEX", "ib_gid_index", int, 0,
         help_="GID index for `ibverbs` (RoCE usually needs one other than 0)"),
    _env("MONARCH_KERNEL_COLLECTIVE_TIMEOUT", "collective_timeout", float, 300.0, unit="s", minimum=1,
         help_="seconds a distributed tensor's reduction or `to_mesh` (and making its process group) waits for "
               "the other ranks before it fails"),
    _env("MONARCH_KERNEL_TENSOR_TRANSFER", "tensor_transfer", str, None, shown="best per pair",
         help_="force how `to_mesh` moves CPU tensors between two ranks: `direct` (one copy out of the peer's "
               "memory, same host only) or `gloo` (torch send/recv)"),
    _env("MONARCH_KERNEL_TENSOR_BATCH", "tensor_batch", int, 512, unit="ops", minimum=1,
         help_="distributed tensor ops the controller records before it sends them to the ranks as one batch"),
    _env("MONARCH_KERNEL_TENSOR_FLUSH", "tensor_flush", float, 0.005, unit="s", minimum=0.0005,
         help_="longest time a recorded distributed tensor op waits on the controller before its batch is sent"),
    # -------------------------------------------- timing constants of the code
    # Liveness: ranks beat to their template, which passes beats on; agents and controllers beat.
    _s("tensor_promise_timeout", 300.0, "tensors/rank/executor.py", "how long a distributed tensor op on a rank "
       "waits for an actor's endpoint to make the result an `rref` promised"),
    _s("tensor_shard_timeout", 60.0, "tensors/rank/executor.py", "how long an endpoint waits for the tensor engine "
       "to make a distributed tensor passed to it"),
    _s("tensor_stream_join", 5.0, "tensors/rank/streams.py", "how long a closing tensor engine waits for each "
       "of its streams' threads to finish what it runs"),
    _s("rank_beat", 1.0, "runtime/rank.py", "how often a rank checks that its template lives and beats to it"),
    _s("template_beats", 0.25, "runtime/template/server.py", "how often a template passes its ranks' beats "
       "on, together (a beat reaches the owner at most 1.25 s old)"),
    _s("output_gather", 0.002, "runtime/template/server.py", "after a template reads a rank's output, how long the "
       "ranks' pipes rest before its next read (its requests are still served at once): a rank printing flat out is "
       "forwarded in chunks of many lines, each costing the controller and the history the same; a line alone goes "
       "at once"),
    _s("answer_resend", 30.0, "runtime/calls/outbox.py", "how long a rank tries again to send an answer that "
       "could not be sent (out of file descriptors for a moment, the caller's queue full), with backoff, before it "
       "reports it lost: the caller waits for that answer"),
    _s("answer_resend_first", 0.05, "runtime/calls/outbox.py", "the first wait before such an answer is tried "
       "again; each later wait doubles, up to a second"),
    _s("agent_beat", 0.5, "runtime/spawn/agent_channel.py", "how often a host agent and its controller beat to "
       "each other"),
    _s("agent_silent", 2.5, "runtime/spawn/agent_channel.py", "silence after which an agent or its controller declares "
       "the other gone; checked every `agent_beat`, so a dead host is declared within 3 s"),
    _s("worker_handshake", 5.0, "agent/worker_wire.py", "how long a connection to a worker (`agent --listen`) "
       "has, in all, to prove it holds the key, and then to hand over the job's credentials"),
    _s("worker_first_proof", 1.0, "agent/worker.py", "how long a connection to a worker has to begin its proof (a "
       "controller does one round trip after the greeting)"),
    _s("worker_retry", 0.2, "job/worker_session.py", "a controller attaching to a worker that is still ending the "
       "ranks of the controller before (or turned it away as too busy) tries again after this"),
    _s("worker_agent_end", 10.0, "agent/worker.py", "how long a worker waits for the agent of a controller that "
       "let go of it (or vanished) to end its ranks before it kills the agent"),
    _s("orphan_sweep_first", 0.2, "runtime/template/server.py", "after a rank exits, when its template first "
       "looks for the rank's orphaned children"),
    _s("orphan_sweep_last", 1.0, "runtime/template/server.py", "... and when it looks the last time"),
    _s("port_guard_every", 10.0, "kernel/port_guard.py", "how often the kernel says, in one line of its log, "
       "how many malformed frames reached its Jupyter ports (between, they are only counted)"),
    _s("stack_dump", 10.0, "runtime/template/stack_sampler.py", "how long one `py-spy dump` of a rank may take "
       "before its template kills it (`%mesh stacks`)"),
    _s("collectives_ask", 5.0, "spmd/controller/collectives.py", "how long `%mesh collectives` waits for each rank "
       "to say where it is in its collectives (one in C code holding the GIL cannot)"),
    _s("stacks_self_wait", 1.0, "observe/stacks.py", "how long `%mesh stacks` waits for ranks to dump their own "
       "stacks before it sends py-spy to those that did not"),
    _s("stacks_wait", 15.0, "observe/stacks.py", "how long `%mesh stacks` waits for every rank's "
       "stack, py-spy's and the in-process fallback's together"),
    _s("exit_drain", 1.0, "runtime/spawn/launcher.py", "at a controller's exit, how long it waits for its local ranks' "
       "last output (what they wrote before it) before it kills them"),
    _s("stop_grace", 2.0, "runtime/spawn/launcher.py", "how long stopped ranks have to exit before they are killed"),
    _s("template_end_grace", 2.0, "runtime/spawn/template_client.py", "how long a template told to end has before it "
       "is killed (one still importing its warm modules reads the word only once they are imported)"),
    _s("cleanup_budget", 1.0, "runtime/calls/finalize.py", "for every actor's `__cleanup__` together, on a stopping "
       "rank (within `stop_grace`)"),
    _s("stop_init_grace", 2.0, "runtime/calls/actor_lives.py", "how long `ActorMesh.stop()` waits for a running "
       "`__init__` to return (then `__cleanup__` runs) before it stops the actor without it"),
    _s("hang_take", 2.0, "spmd/controller/hang_watch.py", "how long a `--then abort` tear-down waits for the "
       "waiting cell (or call) to take its `HangError` before it tears the hung collective down"),
    _s("restart_timeout", 120.0, "actor/self_healing.py", "a rank replaced by its mesh's restart policy that has "
       "not answered its actors' `__init__` by then: that restart failed (its death is counted again if it dies)"),
    _s("restart_idle", 30.0, "actor/self_healing.py", "a mesh's healer thread ends after this long without a death "
       "once its restart policy is off"),
    _s("restart_warm_every", 5.0, "actor/self_healing.py", "how often a mesh whose restart policy is on-failure has "
       "its standby template import the heavy modules its ranks imported (a replaced rank forks from it, warm)"),
    _s("hang_silent", 1.0, "spmd/controller/hang_watch.py", "a rank whose flight-recorder poll is unanswered this "
       "long counts as silent (its stacks are then read with py-spy)"),
    _s("logs_follow", 1.0, "cli/history_commands.py", "how often `monarch-kernel logs --follow` looks for new lines"),
    _s("logs_follow_lag", 60.0, "cli/history_commands.py", "how late a host's batch of lines may land and still be "
       "printed by `monarch-kernel logs --follow`"),
    _s("history_hold", 120.0, "history/writer.py", "a controller's periodic samples alone (an idle mesh: no "
       "lines, events or metrics) wait this long before they are spooled, and spooled batches without lines "
       "this long before a writer process converts them, so that a quiet mesh starts none beside its ranks' "
       "calls; a query, a listing or the controller's exit writes them at once"),
    _s("history_cap_every", 10.0, "history/writer_process.py", "a recorder counts its host's history files again "
       "this often, to keep them and its spool under history_max_bytes while nothing converts the spool"),
    _s("history_writer_idle", 4.0, "history/writer_process.py", "a controller's history writer process given no "
       "batch for this long is let go (the next batch starts another)"),
    _s("elastic_poll", 0.02, "spmd/controller/elastic_members.py", "how often `elastic_run` looks at its ranks' "
       "calls and the mesh's deaths and restarts"),
    _s("elastic_group_poll", 0.2, "spmd/controller/elastic.py", "how long each member of a group `elastic_run` "
       "makes is asked to wait for it, between looks for deaths"),
    _s("elastic_death_grace", 3.0, "spmd/controller/elastic.py", "how long a member's failure in `elastic_run` "
       "waits for a death that explains it"),
    _s("elastic_rendezvous", 60.0, "spmd/controller/elastic.py", "how long `elastic_run` waits for its members "
       "to make a group (torch imported) before it aborts that rendezvous and raises, with where each member is"),
    _s("elastic_join_wait", 10.0, "spmd/controller/elastic.py", "after a death, how long `elastic_run`'s next group "
       "waits for a rank back that is still starting"),
    _s("elastic_store_connect", 15.0, "spmd/rank/elastic.py", "a rank connects to its group's store this long at "
       "most (one closed meanwhile is retried that long)"),
    _s("aborted_group_op", 1.0, "spmd/rank/group.py", "a collective posted on a gloo group after its abort (by "
       "a thread that held the group before it) gives up after this long if its shut connections did not fail it"),
    _s("datagram_retry", 0.0002, "runtime/net/datagram.py", "a same-host link to an inbox that is not there yet "
       "(an actor its rank has not made yet) tries again after this, then twice as long each time"),
    _s("datagram_retry_max", 0.005, "runtime/net/datagram.py", "the longest wait between those tries"),
    _s("inbox_lease_recheck", 0.05, "runtime/net/receiver.py", "how often a thread waiting on an inbox that "
       "another thread reads checks whether it may read it"),
    # The kernel.
    _s("collapse_window", 0.15, "kernel/collapse.py", "how long a line waits for the same line from other ranks"),
    _s("collapse_join_window", 0.5, "kernel/collapse.py", "a line other ranks are joining waits this long again "
       "after each join (the ranks of a large mesh reach it over a second or so)"),
    _s("collapse_hold", 2.0, "kernel/collapse.py", "... up to this long in all"),
    _s("output_batch_gap", 0.02, "kernel/output.py", "under a flood of output, at most one write per this interval"),
    _s("output_tail_gap", 0.1, "kernel/output.py", "the cell's last line (a rank's progress bar, the progress "
       "line) is redrawn at most this often"),
    _s("interrupt_grace", 10.0, "kernel/mesh_cell.py", "how long an interrupted cell waits for the ranks to stop"),
    _s("output_drain", 2.0, "kernel/session.py", "at a cell's end, how long it waits for what its ranks printed "
       "before answering its calls (every host sends what its ranks wrote; a host that does not answer in time is "
       "not waited for)"),
    _s("output_quiet", 5.0, "kernel/mesh_cell.py", "after a `%%mesh` cell's ranks return, how long a rank's output "
       "may be silent before the cell ends without the rest of it (output still arriving keeps it open)"),
    _s("progress_after", 2.0, "kernel/mesh_cell.py", "a `%%mesh` cell running this long shows a progress line"),
    _s("status_refresh", 1.0, "kernel/status.py", "how often the `%mesh status` widget refreshes"),
    _s("detached_start_timeout", 60.0, "kernel/detached.py", "how long a detached mesh's host process has to start"),
    _s("panel_tick", 1.0, "kernel/panel/feed.py", "while a cell runs or a rank is busy: one Mesh panel update per "
       "tick"),
    _s("panel_min_gap", 0.5, "kernel/panel/feed.py", "at most one panel update per this interval, however fast ranks "
       "print"),
    _s("panel_coalesce", 0.05, "kernel/panel/feed.py", "a burst of events (a cell's first lines) makes one update"),
    _s("panel_cpu_stale", 3.0, "kernel/panel/view.py", "an older CPU sample (a rank not shown since) is not averaged "
       "over (3 ticks)"),
    _s("rank_complete", 0.2, "kernel/rank_completion.py", "how long Tab and Shift-Tab in a mesh cell wait for a "
       "rank before the kernel's own namespace answers"),
    # The console, on ranks.
    _s("shell_command_grace", 1.0, "console/shell.py", "a `!cmd` the stop button interrupts has this long to end "
       "on SIGINT before its process group is killed"),
    _s("host_once_stagger", 0.2, "console/host_once.py", "`%pip` once per host: the k-th rank of a host lets the "
       "ranks below it go first for k times this"),
    _s("host_once_poll", 0.02, "console/host_once.py", "... how often it looks whether one of them has"),
    # Debugging.
    _s("pdb_tell_timeout", 30.0, "debug/controller/pdb_controller.py",
       "how long telling a mesh's ranks where to report pdb stops waits for them"),
    _s("pdb_announce_window", 0.2, "debug/controller/pdb_controller.py",
       "ranks stopping in pdb within this window are announced together"),
    _s("pdb_receive_poll", 0.2, "debug/controller/pdb_controller.py",
       "how often pdb's receiver checks whether its hub was closed"),
    _s("pdb_rank_poll", 0.1, "debug/rank/pdb_rank.py", "how often a rank waiting in pdb checks for input (and lets "
       "an interrupt in)"),
    _s("dap_reply_timeout", 60.0, "debug/controller/rank_target.py",
       "how long a debugger request to a rank's debugpy waits"),
    _s("dap_initialize_timeout", 15.0, "debug/controller/rank_target.py",
       "... an `initialize` (debugpy answers at once "
       "when it takes the connection at all)"),
    _s("dap_inspect_timeout", 5.0, "debug/controller/rank_target.py",
       "... a variable panel request (asked often: never "
       "holds the others up long)"),
    _s("tunnel_open_timeout", 30.0, "debug/controller/tunnel.py", "how long opening a debugger tunnel to a rank waits"),
    _s("tunnel_send_timeout", 30.0, "debug/controller/tunnel.py", "how long the rank's relay has to take one request"),
    _s("tunnel_close_wait", 1.0, "debug/controller/tunnel.py",
       "how long closing a tunnel waits for the relay's last word"),
    _s("tunnel_exit_timeout", 2.0, "debug/controller/tunnel.py",
       "for closing the debugger sessions as the kernel exits"),
    _s("tunnel_lease", 15.0, "debug/controller/tunnel.py",
       "a relay not renewed for this long (the kernel died) ends its session"),
    _s("tunnel_renew", 3.0, "debug/controller/tunnel.py", "how often an idle debugger session is renewed"),
    _s("listen_screen_timeout", 10.0, "debug/controller/listen_gate.py",
       "how long a client of a `%mesh debug R --listen` port has to send its attach with the session's secret"),
    _s("debugpy_start_timeout", 30.0, "debug/rank/rank_debugpy.py",
       "for a rank's debug adapter to start (`%mesh debug R`, the first time)"),
    _s("relay_connect_timeout", 10.0, "debug/rank/relay.py", "for a rank's relay to connect to its debugpy"),
    _s("relay_settle", 0.2, "debug/rank/relay.py", "a new debugger session connects this long after the last one "
       "ended (debugpy's adapter needs it)"),
    _s("relay_accept_wait", 5.0, "debug/rank/relay.py",
       "how long a new debugger session waits for debugpy's adapter to finish accepting it"),
    _s("relay_end_wait", 3.0, "debug/rank/relay.py", "how long a new debugger session waits for the old ones to end"),
    _s("env_probe_timeout", 120.0, "job/env_sync.py", "how long sync_env waits for a host to say what its Python "
       "and cache hold, before anything is sent (a busy host, through a login node, took over 30 s)"),
    _s("rendezvous_answer_grace", 30.0, "tensors/rendezvous_actor.py", "a rank waits this long past a rendezvous "
       "wait's own timeout for the controller's answer (the trip, a busy controller) before it stops listening"),
    # Data plane, distributed training, jobs, the server extension.
    _s("data_connect_timeout", 2.0, "data/client.py", "for a connection to a buffer owner's data server"),
    _s("data_busy_wait", 10.0, "data/client.py", "how long to keep trying an owner whose server turns "
       "connections away"),
    _s("data_accept_backoff", 0.5, "data/server.py", "longest pause of a data server that ran out of file "
       "descriptors or memory to accept with"),
    _s("spmd_setup_timeout", 120.0, "spmd/controller/env.py",
       "for a mesh's torch.distributed environment to be set up"),
    _s("slurm_command_timeout", 60.0, "job/slurm_commands.py", "one sbatch/squeue/scancel call (slurmctld retries when "
       "it is busy)"),
    _s("slurm_cancel_timeout", 60.0, "job/slurm_commands.py", "scancel until squeue no longer lists the job as active"),
    _s("server_helper_timeout", 60.0, "monarch_kernel_server/handlers.py", "the Jupyter Server extension's "
       "wait for its helper process"),
    _s("server_kernel_timeout", 120.0, "monarch_kernel_server/handlers.py", "the Jupyter Server extension's "
       "wait for a kernel to run its request"),
]}
