"""A host agent's part of the history: its ranks' lines and metrics into this host's files,
under the run the controller gave the spawn (the controller records only the ranks it forks
itself), and those files sent back to the controller when it asks (``HistoryAsk``), over the
agent's own authenticated link.  Runs in the agent, on its IO thread but for reading files,
which a thread of its own does; its batches are spooled, and converted by a writer process
of its own at the lowest priority, as a controller's are (``writer_process``)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..runtime.hosting import LineReader, config, host_messages
from . import places
from .convert import convert
from .recorder import process_writer, record_hook
from .writer import HistoryWriter

HISTORY_SETTINGS = ("record_history", "history_dir", "history_max_bytes", "history_flush")


def _shown_nowhere(mesh: str, rank: int, stream: str, line: str) -> None:
    """The agent's own sink: its ranks' output goes to the controller, not its terminal."""


class HostHistory:
    """The lines of the ranks an agent forked, by pid; None when the history is off."""

    def __init__(self):
        self.readers: dict[int, list[LineReader]] = {}
        self.writer: HistoryWriter | None = None

    def forked(self, pid: int, mesh: str, rank: int, host: str, env: dict) -> None:
        """Rank ``rank`` of ``mesh`` (on this host, which the controller calls ``host``) is
        ``pid``; ``env``: its launch environment, whose history settings (the controller's,
        ``history_dir`` on a shared file system, say) this host follows from the first."""
        if self.writer is None:
            for name in HISTORY_SETTINGS:
                if config.env_name(name) in env and config.given(name) is None:
                    config.set(name, env[config.env_name(name)])
        if not config.get("record_history"):
            return
        if self.writer is None:
            self.writer = process_writer(host=host)  # spooled, converted by a writer process at idle
        writer = self.writer
        assert writer is not None
        run = env.get(config.env_name("history_run"))
        if run and writer.run_of(mesh) != places.safe(run):  # a spawn's first rank here: its run
            writer.begin_run(mesh, run)
        record = record_hook(writer)
        self.readers[pid] = [LineReader(mesh, rank, stream, lambda: _shown_nowhere, lambda: [record])
                             for stream in ("stdout", "stderr")]

    def output(self, pid: int, fd: int, data: bytes) -> None:
        readers = self.readers.get(pid)
        if readers is not None and fd in (1, 2):
            readers[fd - 1].feed(data)

    def exited(self, pid: int) -> None:
        for reader in self.readers.pop(pid, ()):
            reader.close()

    def flush(self) -> None:
        """Every row gathered so far in this host's Parquet files (before they are sent)."""
        if self.writer is not None:
            self.writer.flush()
            convert(self.writer.root, self.writer.host)

    def ask(self, msg: host_messages.HistoryAsk, say: Callable[[host_messages.Message], None]) -> None:
        """Send the files asked for; ``say`` must be callable from any thread."""
        threading.Thread(target=self._send, args=(msg, say), name="monarch-history-send", daemon=True).start()

    def _send(self, msg: host_messages.HistoryAsk, say) -> None:
        """Every run's files of the mesh on this host, each in the message's ``host`` as
        ``RUN/HOST`` (its folder under the mesh's), ``have`` naming them ``RUN/FILE``."""
        hf = host_messages.HistoryFile
        host = self.writer.host if self.writer is not None else places.host_name()
        try:
            self.flush()
            have = set(msg.have)
            for run, folders in sorted(places.runs_of(places.history_root() / places.safe(msg.mesh)).items()):
                folder = next((f for f in folders if f.name == places.safe(host)), None)
                if run == places.LEGACY or folder is None:
                    continue
                names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".parquet") or
                               p.name == places.META)
                for name in names:
                    if f"{run}/{name}" in have and name != places.META:
                        continue
                    try:
                        data = (folder / name).read_bytes()
                    except FileNotFoundError:  # rotated away meanwhile
                        continue
                    say(hf(msg.tag, f"{run}/{places.safe(host)}", name, data, False))
        except OSError as e:
            say(hf(msg.tag, places.safe(host), "", b"", True, f"the history on {host} could not be read: {e}"))
            return
        say(hf(msg.tag, places.safe(host), "", b"", True))
