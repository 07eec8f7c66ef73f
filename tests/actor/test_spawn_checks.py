"""Spawn arguments are checked before anything starts: a rank count the host cannot hold
(memory, process and open-files limits), names that are not names, environments no process
can have.  Each refusal is a ValueError or TypeError saying what to type; no process starts
and the controller does not grow.  The override lets a refused count through."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import psutil
import pytest
from support.actors import Echo
from support.config import configured

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.runtime import config
from monarch_kernel.runtime.process import Runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OVERRIDE = "If you know better, spawn_procs(..., check_limits=False) or MONARCH_KERNEL_CHECK_LIMITS=0 skips this check"
NAME_RULE = ("cannot name a mesh: files are named after it, so it takes 1 to 64 ASCII letters, digits, '_', '.' and "
             "'-', and starts with a letter, a digit or '_', e.g. name='trainers'")
DIM_RULE = ("cannot name a dim: dims are keyword arguments of slice (mesh.slice(gpus=0)), so a dim is a Python "
            "identifier (ASCII letters, digits and '_', not starting with a digit) and no keyword, e.g. 'gpus'")
MIB = 1 << 20


class EnvReader(Actor):
    @endpoint
    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


BAD = [
    # (spawn_procs keywords, error type, the message, exactly)
    (dict(per_host={"gpus": 2**70}), ValueError,
     "spawn_procs(per_host={'gpus': 1180591620717411303424}): 1,180,591,620,717,411,303,424 ranks on one host "
     "is more than any Linux host runs processes (4,194,304, the largest pid_max); spawn fewer, "
     "e.g. per_host={'gpus': 4}"),
    (dict(per_host={"gpus": 2**70}, check_limits=False), ValueError, "ranks on one host is more than any Linux host"),
    (dict(per_host={"hosts": 2**40, "gpus": 2**40}), ValueError, "1,208,925,819,614,629,174,706,176 ranks on one host"),
    (dict(per_host={"gpus": 2}, name="a/b"), ValueError, f"spawn_procs(name=...): 'a/b' {NAME_RULE}"),
    (dict(per_host={"gpus": 2}, name=""), ValueError, f"'' {NAME_RULE}"),
    (dict(per_host={"gpus": 2}, name=".."), ValueError, f"'..' {NAME_RULE}"),
    (dict(per_host={"gpus": 2}, name="-x"), ValueError, f"'-x' {NAME_RULE}"),
    (dict(per_host={"gpus": 2}, name="x" * 65), ValueError, NAME_RULE),
    (dict(per_host={"gpus": 2}, name="é"), ValueError, f"'é' {NAME_RULE}"),
    (dict(per_host={"gpus": 2}, name=5), TypeError,
     "spawn_procs(name=...): a mesh's name is a string, not int, e.g. name='trainers'"),
    (dict(per_host={"a/b": 2}), ValueError, f"per_host={{'a/b': 2}}: 'a/b' {DIM_RULE}"),
    (dict(per_host={"": 2}), ValueError, f"per_host={{'': 2}}: '' {DIM_RULE}"),
    (dict(per_host={"class": 2}), ValueError, f"'class' {DIM_RULE}"),
    (dict(per_host={"1x": 2}), ValueError, f"'1x' {DIM_RULE}"),
    (dict(per_host={3: 2}), TypeError, "per_host={3: 2}: a dim is named by a string, e.g. 'gpus'; got 3"),
    (dict(per_host=[("gpus", 2)]), TypeError,
     "per_host takes a dict of dim -> size, e.g. per_host={'gpus': 4}; got [('gpus', 2)]"),
    (dict(per_host={"gpus": 2}, env={"X": 5}), TypeError,
     "env['X'] is 5, of type int; environment values are strings: env={'X': '5'}"),
    (dict(per_host={"gpus": 2}, env={"X": "a\0b"}), ValueError,
     "env['X'] holds a NUL byte at 1, which no environment variable can hold (the C string ends there); remove it"),
    (dict(per_host={"gpus": 2}, env={"X=Y": "1"}), ValueError,
     "env: 'X=Y' cannot name an environment variable: a name is not empty and holds no '=', NUL byte or character "
     "the file system's encoding cannot write; e.g. env={'OMP_NUM_THREADS': '1'}"),
    (dict(per_host={"gpus": 2}, env={"": "1"}), ValueError, "env: '' cannot name an environment variable"),
    (dict(per_host={"gpus": 2}, env={"X\0": "1"}), ValueError, "env: 'X\\x00' cannot name an environment variable"),
    (dict(per_host={"gpus": 2}, env={5: "1"}), TypeError,
     "env: the name 5 is of type int; names are strings, e.g. env={'OMP_NUM_THREADS': '1'}"),
    (dict(per_host={"gpus": 2}, env={"X": "\ud800"}), ValueError,
     "env['X'] holds a character the file system's encoding (utf-8) cannot write"),
    (dict(per_host={"gpus": 2}, env=["X=1"]), TypeError, "env takes a dict of str -> str"),
]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs,error,message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_spawn_is_refused_before_anything_starts(kwargs, error, message):
    Runtime.current()  # the runtime itself is no part of what is measured
    before, rss = _children(), psutil.Process().memory_info().rss
    with pytest.raises(error) as info:
        this_host().spawn_procs(**kwargs)
    text = str(info.value)
    assert text == message or (message in text and len(message) < len(text)), text
    assert _children() - before == set(), "a process was started"
    assert psutil.Process().memory_info().rss - rss < 16 * MIB, "the controller grew"


@pytest.mark.timeout(60)
def test_more_ranks_than_free_memory_holds_are_refused_with_what_fits():
    """The issue's 100,000 (where this host cannot hold them), and a count just past the free
    memory at the measured cost of a rank: refused at once, saying how many fit."""
    cost = config.rank_memory()
    for n in (100_000, _available() // cost + 64):
        if n * cost <= _available():
            continue  # a host with room for 100,000 idle ranks
        before, rss = _children(), psutil.Process().memory_info().rss
        with pytest.raises(ValueError) as info:
            this_host().spawn_procs(per_host={"gpus": n})
        text = str(info.value)
        assert text.startswith(f"spawn_procs(per_host={{'gpus': {n}}}) refused before starting anything: "), text
        assert text.endswith(OVERRIDE), text
        fits = int(re.search(r"room for ([\d,]+) more ranks per host, not", text).group(1).replace(",", ""))
        assert fits < n and f"e.g. per_host={{'gpus': {fits}}}" in text
        assert "an idle rank takes about 8 MiB (MONARCH_KERNEL_RANK_MEMORY)" in text or "tasks" in text, text
        assert _children() - before == set()
        assert psutil.Process().memory_info().rss - rss < 16 * MIB


@pytest.mark.timeout(90)
def test_the_override_lets_a_refused_count_through():
    """With a rank said to cost 1 PiB no host holds 2 ranks; check_limits=False (or the
    setting) spawns them anyway, and they answer."""
    with configured(rank_memory=1 << 50):
        before = _children()
        with pytest.raises(ValueError) as info:
            this_host().spawn_procs(per_host={"gpus": 2})
        text = str(info.value)
        assert "an idle rank takes about 1,024 TiB (MONARCH_KERNEL_RANK_MEMORY), so 2 ranks need 2,048 TiB" in text
        assert "So there is room for 0 more ranks per host, not 2." in text and text.endswith(OVERRIDE)
        assert _children() - before == set()
        with this_host().spawn_procs(per_host={"gpus": 2}, check_limits=False) as procs:
            assert list(procs.spawn("echo", Echo).echo.call(1).get(timeout=30).values()) == [1, 1]
        with configured(check_limits=False), this_host().spawn_procs(per_host={"gpus": 1}) as procs:
            assert procs.spawn("echo", Echo).echo.call_one(2).get(timeout=30) == 2


# A fresh controller whose open-files limit is lowered to just under what N ranks need (by the
# measured cost): the check refuses them; with the override they spawn and answer, since the
# measured cost has room to spare.
NOFILE_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    from support.actors import Echo
    from monarch_kernel import this_host
    from monarch_kernel.runtime import limits
    from monarch_kernel.runtime.spawn import capacity
    n = int(sys.argv[1])
    warm = this_host().spawn_procs(per_host={"gpus": 1})  # the template, started with the usual limit
    warm.spawn("echo", Echo).echo.call_one(0).get(timeout=60)
    held = limits.open_files()
    need = n * capacity.CONTROLLER_FILES_PER_RANK + capacity.CONTROLLER_FILES_PER_TEMPLATE
    lowered = held + limits.RESERVE + need - 3  # a little short of what the check asks
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, lowered))
    out = {"lowered": lowered}
    try:
        this_host().spawn_procs(per_host={"gpus": n})
    except ValueError as e:
        out["refused"] = str(e)
    # Past the check, the spawn starts (what the ranks can then do at this limit is the runtime's
    # own business: a call that runs out fails at once saying how to raise it, tests/system/test_scale.py).
    procs = this_host().spawn_procs(per_host={"gpus": n}, check_limits=False)
    out["spawned"] = len(procs)
    procs.stop().get(timeout=60)
    warm.stop().get(timeout=60)
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.timeout(120)
def test_open_files_limit_refuses_and_the_override_spawns(tmp_path):
    n = 12
    script = tmp_path / "nofile.py"
    script.write_text(NOFILE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    proc = subprocess.run([sys.executable, str(script), str(n)], capture_output=True, text=True, timeout=100,
                          env=env, cwd=str(tmp_path))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = json.loads(line[len("RESULT "):])
    refused = out.get("refused", "")
    assert refused.startswith(f"spawn_procs(per_host={{'gpus': {n}}}) refused before starting anything: the "
                              f"controller needs about 1 open file per rank ({n + 2} for these), and it "
                              "holds "), refused
    fits = re.search(rf"of its limit of {out['lowered']:,} \(`ulimit -n`, RLIMIT_NOFILE; 32 are kept free\)\. So there "
                     rf"is room for (\d+) more ranks per host, not {n}; e\.g\. per_host=\{{'gpus': (\d+)\}}\.", refused)
    assert fits and fits.group(1) == fits.group(2) and int(fits.group(1)) < n, refused
    assert refused.endswith(OVERRIDE)
    assert out["spawned"] == n


@pytest.mark.timeout(90)
def test_valid_names_dims_and_env_still_spawn():
    """The rules refuse only what breaks: dotted and dashed mesh names, any identifier dims,
    and non-ASCII environment values reach real ranks."""
    with this_host().spawn_procs(per_host={"dp": 1, "tp_2": 2}, name="train.v1-2_x",
                                 env={"MK_TEST_VALUE": "grüße", "MK_EMPTY": ""}) as procs:
        assert procs.name == "train.v1-2_x" and procs.extent == {"dp": 1, "tp_2": 2}
        readers = procs.spawn("env", EnvReader)
        assert list(readers.getenv.call("MK_TEST_VALUE").get(timeout=30).values()) == ["grüße"] * 2
        assert readers.slice(tp_2=1).getenv.call_one("MK_EMPTY").get(timeout=30) == ""
        flat = procs.flatten("rank")
        assert flat.extent == {"rank": 2}
        for bad, call in (("a b", lambda: procs.flatten("a b")), ("for", lambda: procs.rename(tp_2="for")),
                          ("x-y", lambda: procs.split(tp_2=("x-y", "z"), z=1))):
            with pytest.raises(ValueError, match=re.escape(f"{bad!r} {DIM_RULE}")):
                call()


@pytest.mark.timeout(120)
def test_the_magics_refuse_before_a_detached_host_or_a_rank_starts(kc):
    """``%mesh spawn`` (and ``--detach``, whose host process would spawn the ranks) checks in
    the kernel: no host process, no record, no rank; the setting lets a spawn through."""
    from support.kernels import run, text

    from monarch_kernel.detached.records import info_path

    _, reply = run(kc, "import os, psutil; kernel = psutil.Process(os.getpid())")
    assert reply["status"] == "ok"
    out, reply = run(kc, f"%env MONARCH_KERNEL_RANK_MEMORY={1 << 50}")
    for line in ("procs = %mesh spawn -n 2 --detach roomless", "procs = %mesh spawn -n 2"):
        out, reply = run(kc, line)
        assert reply["status"] == "error" and reply["ename"] == "ValueError", text(out)
        assert reply["evalue"].startswith("spawn_procs(per_host={'ranks': 2}) refused before starting anything: "
                                          "an idle rank takes about 1,024 TiB"), reply["evalue"]
        assert reply["evalue"].endswith(OVERRIDE)
    assert not os.path.exists(info_path("roomless"))
    out, reply = run(kc, "print('children', len(kernel.children(recursive=True)))")
    assert "children 0" in text(out), text(out)
    out, reply = run(kc, "%mesh spawn -n 2 --name a/b")
    assert reply["ename"] == "UsageError" and "'a/b' cannot name a mesh" in reply["evalue"]
    out, reply = run(kc, "%env MONARCH_KERNEL_CHECK_LIMITS=0")
    out, reply = run(kc, "procs = %mesh spawn -n 1 --name ok.1\nlen(procs)")
    assert reply["status"] == "ok" and "1" in text(out), text(out)
    out, reply = run(kc, "%mesh stop ok.1")
    assert reply["status"] == "ok", text(out)
