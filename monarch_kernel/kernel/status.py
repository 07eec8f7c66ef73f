"""``%mesh status``: each rank's host, pid, state (idle/busy/dead), memory and last output
line, as a text table and, where widgets render, a live grid that keeps updating while
cells run."""

from __future__ import annotations

import html
import os
import threading

from ..runtime import Runtime, config, counted

REFRESH_S = config.seconds("status_refresh")


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of a local process, from /proc (no extra dependency)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except (OSError, ValueError, IndexError):
        return None


def snapshot(procs, last_lines, host=None) -> list[dict]:
    """The status table's rows: ``procs.rank_states()`` (from the detached mesh's ``host``
    when there is one: it owns the ranks), with this kernel's view of which are busy, each
    rank's memory and its last output line."""
    rows = procs.rank_states() if host is None else host.status.call_one().get(timeout=30)
    busy = Runtime.current().busy_ranks(procs.ref.id)
    out = []
    for row in rows:
        r, state = row["rank"], row["state"]
        if state == "dead":
            state = f"dead ({row['death']})"
        elif state == "not responding":
            state = f"not responding ({row['silent_s']:.0f} s; %mesh restart replaces it)"
        else:
            state = "busy" if r in busy else "idle"
        # A remote pid is not ours; past SUMMARY_OVER ranks only those shown one by one are measured.
        quiet = len(rows) > SUMMARY_OVER and state == "idle"
        rss = None if row["death"] or row.get("remote") or quiet else rss_mib(row["pid"])
        out.append({"rank": r, "host": row["host"], "pid": row["pid"], "state": state,
                    "rss": "" if rss is None else f"{rss:.0f} MiB", "last": last_lines.get((procs.name, r), "")})
    return out


SUMMARY_OVER = 32  # larger meshes are summarised: counts by state, and only the ranks that are not idle


def counts(rows: list[dict]) -> dict[str, int]:
    """How many ranks are in each state ("dead (...)" counts as "dead")."""
    out: dict[str, int] = {}
    for row in rows:
        state = row["state"].split(" (", 1)[0]
        out[state] = out.get(state, 0) + 1
    return out


def notable(rows: list[dict], full: bool) -> list[dict]:
    """The rows to show one by one: all of them for a small mesh (or ``full``), else the
    ranks that are not idle (dead, busy, stopped, not responding)."""
    if full or len(rows) <= SUMMARY_OVER:
        return rows
    return [row for row in rows if row["state"] != "idle"]


def as_text(name: str, rows: list[dict], detached: bool = False, full: bool = False) -> str:
    alive = sum(1 for row in rows if not row["state"].startswith("dead"))
    out = [f"mesh {name}{' (detached)' if detached else ''}: {counted(len(rows), 'rank')}, {alive} alive"]
    shown = notable(rows, full)
    if shown is not rows:
        out[0] += " (" + ", ".join(f"{k} {v}" for k, v in sorted(counts(rows).items())) + \
            "; %mesh status --all lists every rank)"
    for row in shown:
        last = f"  | {row['last'][:60]}" if row["last"] else ""
        out.append(f"  rank {row['rank']}: pid {row['pid']} on {row['host']}, {row['state']}"
                   f"{', ' + row['rss'] if row['rss'] else ''}{last}")
    return "\n".join(out)


def as_html(name: str, rows: list[dict], full: bool = False, note: str = "") -> str:
    colour = {"idle": "#2e7d32", "busy": "#f9a825", "stopped": "#757575"}
    shown = notable(rows, full)
    summary = ""
    if shown is not rows:
        summary = (" &middot; " + ", ".join(f"{html.escape(k)} {v}" for k, v in sorted(counts(rows).items()))
                   + f" &middot; {len(shown)} not idle shown (<code>%mesh status --all</code>: every rank)")
    if note:
        summary += f" &middot; {html.escape(note)}"
    rows = shown
    cells = "".join(
        f"<tr><td>{row['rank']}</td><td>{html.escape(str(row['host']))}</td><td>{row['pid']}</td>"
        f"<td style='color:{colour.get(row['state'], '#c62828')}'>{html.escape(row['state'])}</td>"
        f"<td>{row['rss']}</td><td><code>{html.escape(row['last'][:80])}</code></td></tr>"
        for row in rows
    )
    return (f"<b>mesh {html.escape(name)}</b>{summary}<table><tr><th>rank</th><th>host</th><th>pid</th>"
            f"<th>state</th><th>memory</th><th>last line</th></tr>{cells}</table>")


def stopped(rows: list[dict]) -> list[dict]:
    """The rows of a mesh that has stopped: every rank "stopped" (the dead stay dead), no
    memory, the last line kept."""
    return [{**row, "state": row["state"] if row["state"].startswith("dead") else "stopped", "rss": ""}
            for row in rows]


class LiveStatus:
    """A widget that shows one mesh, refreshed every second from a background thread, until
    the mesh stops: then its last word is that every rank stopped, and it is not refreshed again."""

    def __init__(self, session, full: bool = False):
        import ipywidgets

        self.session = session
        self.full = full
        self.procs, _consoles = session.get()
        self.name = self.procs.name
        self.widget = ipywidgets.HTML()
        self.rows: list[dict] = []
        self.final = False
        self._lock = threading.Lock()  # one refresh at a time: the thread's, or the kernel's at a stop
        self._stop = threading.Event()
        self.refresh()
        threading.Thread(target=self._loop, name="mesh-status", daemon=True).start()

    def _gone(self) -> bool:
        got = self.session.meshes.get(self.name)
        return got is None or got[0] is not self.procs or self.procs.stopped

    def refresh(self) -> bool:
        """Show the mesh now; False once it has stopped (its final state is shown)."""
        with self._lock:
            if self.final:
                return False
            if not self._gone():
                try:
                    self.rows = snapshot(self.procs, self.session.last_lines,
                                         self.session.hosts.get(self.name))
                except Exception:  # noqa: BLE001  (a mesh mid-stop: the next look says so)
                    return not self._gone()
                self.widget.value = as_html(self.name, self.rows, self.full)
                return True
            self.final = True
            self._stop.set()
            self.widget.value = as_html(self.name, stopped(self.rows), self.full, note="stopped")
            return False

    def _loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            if not self.refresh():
                return

    def close(self, note: str = "") -> None:
        """Stop refreshing; ``note`` (why) is then the widget's last word."""
        self._stop.set()
        if note:
            with self._lock:
                if not self.final:
                    self.final = True
                    self.widget.value = as_html(self.name, self.rows, self.full, note=note)
