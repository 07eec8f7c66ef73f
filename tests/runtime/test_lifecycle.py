"""Process lifecycle: a rank exiting mid-call reports its exit code and stderr, and rank
output is forwarded with its rank, all of it even when the controller exits at once.  (Calls
to ranks that die: test_caller.py; spawn, stop and restart: test_launcher.py; supervision:
test_supervision.py.)"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.actors import Echo, wait_for
from support.scripts import run_script, write_script

from monarch_kernel import Actor, ProcessDied, endpoint, this_host
from monarch_kernel.runtime.process import Runtime


@pytest.mark.timeout(60)
def test_os_exit_in_endpoint_reports_exit_code_and_stderr():
    with this_host().spawn_procs(per_host={"gpus": 2}, name="exiters") as procs:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())
        with pytest.raises(ProcessDied) as info:
            m.slice(gpus=1).exit_with.call_one(3, "about to exit: goodbye").get(timeout=30)
        err = info.value
        assert (err.rank, err.exitcode, err.signal, err.pid) == (1, 3, None, pids[1])
        assert err.stderr_tail[-1] == "about to exit: goodbye"
        assert str(err).startswith(f"rank 1 of mesh 'exiters' (pid {pids[1]} on {err.host}) exited with code 3\n")
        assert str(err).endswith("last lines of its stderr:\n    about to exit: goodbye")
        assert err.method == "exit_with"
        assert m.slice(gpus=0).echo.call_one("still here").get(timeout=20) == "still here"


# ---------------------------------------------------------------- rank output


LAST_WORDS = """
from monarch_kernel import Actor, current_rank, endpoint, this_host

class Shout(Actor):
    @endpoint
    def shout(self, n):
        for i in range(n):
            print(f"last {current_rank().rank} {i} " + "x" * 400, flush=True)

procs = this_host().spawn_procs(per_host={"r": 4})
shout = procs.spawn("shout", Shout)
shout.shout.call(1).get()
# A busy machine, made certain: the template that reads the ranks' pipes is frozen while
# they print, and thaws 0.3 s after the script has reached its end.
import os, signal, threading
from monarch_kernel.runtime.process import Runtime
template = next(iter(Runtime.current().launcher.templates.values())).proc.pid
os.kill(template, signal.SIGSTOP)
shout.shout.call(1500).get()
threading.Timer(0.3, os.kill, (template, signal.SIGCONT)).start()
"""  # and the script ends at once, its meshes still up


@pytest.mark.timeout(60)
def test_what_ranks_printed_before_the_controller_exits_is_shown(tmp_path):
    out = run_script(write_script(tmp_path, "last_words.py", LAST_WORDS))
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if " last " in line]
    for r in range(4):
        mine = [line for line in lines if line.startswith(f"[rank {r}] last {r} ")]
        # about 0.6 MB each (a pipe holds it all), written just before the script ends: still in the ranks' pipes
        # (and the template's socket) when the controller reaches its exit
        want = [f"[rank {r}] last {r} 0 " + "x" * 400] + [f"[rank {r}] last {r} {i} " + "x" * 400 for i in range(1500)]
        assert mine == want, (r, len(mine), [line[:30] for line in mine[-2:]])


@pytest.mark.timeout(60)
def test_rank_output_is_forwarded_with_its_rank():
    rt = Runtime.current()
    lines: list[tuple] = []
    sink = rt.hooks.output.install(lambda mesh, rank, stream, line: lines.append((mesh, rank, stream, line)))
    try:
        with this_host().spawn_procs(per_host={"gpus": 2}, name="talkers") as procs:
            m = procs.spawn("echo", Echo)
            assert list(m.chatter.call("T1").get(timeout=30).values()) == [0, 1]
            expected = set()
            for r in range(2):
                expected |= {
                    ("talkers", r, "stdout", f"T1 print from rank {r}"),
                    ("talkers", r, "stderr", f"T1 stderr from rank {r}"),
                    ("talkers", r, "stdout", f"T1 os.write from rank {r}"),
                    ("talkers", r, "stdout", f"T1 child process of rank {r}"),
                }
            wait_for(lambda: expected <= set(lines), 20)
            assert sorted(expected - set(lines)) == []
            # Per rank and stream, lines arrive in the order they were written.
            rank0 = [line for (_, r, s, line) in list(lines) if r == 0 and s == "stdout" and line.startswith("T1")]
            assert rank0 == ["T1 print from rank 0", "T1 os.write from rank 0", "T1 child process of rank 0"]
    finally:
        sink.remove()


class Steady(Actor):
    @endpoint
    def steady(self, n: int, every_us: float) -> int:
        """``n`` lines, one every ``every_us`` microseconds (a training loop's log, flat out)."""
        t = time.perf_counter()
        for i in range(n):
            print(f"steady {i}")
            while (time.perf_counter() - t) * 1e6 < (i + 1) * every_us:
                pass
        sys.stdout.flush()
        return n


@pytest.mark.timeout(60)
def test_a_rank_printing_steadily_is_forwarded_in_chunks_of_many_lines():
    """A line every 50 us: the template lets the rank's pipe gather between its reads
    (``GATHER_S``), so each chunk the controller reads, and the history records, holds many
    lines, not one or two; and every line arrives, once, in order."""
    rt = Runtime.current()
    chunks: list[bytes] = []
    handle = rt.hooks.record.install(lambda mesh, rank, stream, data: chunks.append(data) if mesh == "steady" else None)
    try:
        with this_host().spawn_procs(per_host={"r": 1}, name="steady") as procs:
            assert procs.spawn("s", Steady).steady.call_one(10000, 50).get(timeout=30) == 10000
            wait_for(lambda: sum(c.count(b"\n") for c in chunks) >= 10000, 20)
    finally:
        handle.remove()
    got = b"".join(chunks).decode().splitlines()
    assert got == [f"steady {i}" for i in range(10000)]
    assert len(got) / len(chunks) >= 5, f"{len(chunks)} chunks for {len(got)} lines"


class Starved(Actor):
    @endpoint
    def answer_starved(self, seconds: float) -> int:
        """Answer with no file descriptor left to open (the soft limit at the lowest free one),
        the limit given back ``seconds`` later."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        free = os.open(os.devnull, os.O_RDONLY)
        os.close(free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (free, hard))
        threading.Timer(seconds, resource.setrlimit, (resource.RLIMIT_NOFILE, (soft, hard))).start()
        return os.getpid()


@pytest.mark.timeout(90)
def test_an_answer_that_cannot_be_sent_for_a_moment_is_sent_once_it_can():
    """A rank out of file descriptors for 1.5 s as it answers a caller it has never answered
    (a thread of its own: a connection to open): the answer is sent again once it can be,
    not dropped while the caller waits for ever."""
    with this_host().spawn_procs(per_host={"r": 1}, name="starved") as procs:
        m = procs.spawn("s", Starved)
        with ThreadPoolExecutor(1) as pool:  # a caller the rank has no connection to yet
            t = time.monotonic()
            pid = pool.submit(lambda: m.answer_starved.call_one(1.5).get(timeout=30)).result()
        assert time.monotonic() - t >= 1.0  # it came once the limit was back
        assert pid == procs.rank_states()[0]["pid"]
