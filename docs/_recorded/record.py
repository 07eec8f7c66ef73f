"""Records the examples of the "beyond one machine" guide that need other hosts, which a docs
build does not have: each runs once, as a script, against hosts simulated on this machine
(network namespaces on a bridge, each with its own hostname and sshd: tests/support/cluster.py),
and its code and output are written to ``docs/_recorded/NAME.md``, marked with where and when,
for the guide to include.  Nothing here runs at build time; run it again (as root, from the
checkout's root) when the examples change (all of them, or those named)::

    python docs/_recorded/record.py [ssh] [workers] [slurm] [slurm_login]
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from support.cluster import checkout_python, slurm_login, slurm_network, ssh_config_file, ssh_network  # noqa: E402

HOSTS_NOTE = ("this machine's two simulated hosts (network namespaces on a bridge, each with its own "
              "hostname, `mk-h1` and `mk-h2`, and its own sshd: `tests/support/cluster.py`)")

# ssh reaches the simulated hosts as node1 and node2 through ssh_config (the test key, no
# known_hosts): the names an ~/.ssh/config would give.
SSH = '''\
import os
import socket
import time

from monarch_kernel import Actor, current_rank, endpoint
from monarch_kernel.job import SSHJob


class Where(Actor):
    @endpoint
    def where(self) -> str:
        return f"rank {current_rank().rank}: {socket.gethostname()}, pid {os.getpid()}"


started = time.monotonic()
job = SSHJob(python_exe=PYTHON, ssh_args=("-F", "ssh_config"))   # Host node1, node2 in ssh_config
job.add_mesh("workers", ["node1", "node2"])
procs = job.state().workers.spawn_procs(per_host={"gpus": 2})
where = procs.spawn("where", Where)
answers = where.where.call().get(timeout=60)
print(f"{procs.extent}: first answers {time.monotonic() - started:.1f} s after SSHJob()")
for line in answers.values():
    print(line)
job.kill()                              # every agent and rank, on every host
'''

WORKERS = '''\
import os
import socket
import time

from monarch_kernel import Actor, attach_to_workers, current_rank, endpoint


class Where(Actor):
    @endpoint
    def where(self) -> str:
        return f"rank {current_rank().rank}: {socket.gethostname()}, pid {os.getpid()}"


started = time.monotonic()
hosts = attach_to_workers(workers=WORKERS, key="mk-key")
procs = hosts.spawn_procs(per_host={"gpus": 2})
answers = procs.spawn("where", Where).where.call().get(timeout=60)
print(f"{procs.extent}: first answers {time.monotonic() - started:.1f} s after attach_to_workers()")
for line in answers.values():
    print(line)
hosts.shutdown().get(timeout=60)        # the ranks end, and the workers exit too
'''


SLURM = '''\
import os
import socket
import subprocess
import time

from monarch_kernel import Actor, current_rank, endpoint
from monarch_kernel.job import SlurmJob


class Where(Actor):
    @endpoint
    def where(self) -> str:
        return (f"rank {current_rank().rank}: {socket.gethostname()}, Slurm job {os.environ['SLURM_JOB_ID']}, "
                f"pid {os.getpid()}")


started = time.monotonic()
job = SlurmJob(meshes={"trainers": 2}, partition="mk", time_limit="00:10:00")
procs = job.state().trainers.spawn_procs(per_host={"gpus": 2})   # waits for the allocation
answers = procs.spawn("where", Where).where.call().get(timeout=60)
print(f"{procs.extent} on {job.nodes}: first answers {time.monotonic() - started:.1f} s after SlurmJob()")
for line in answers.values():
    print(line)
job.kill()                              # scancel: the allocation is freed
print("squeue after kill():", subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout or "(empty)")
'''


SLURM_LOGIN = '''\
import os
import socket
import time

from monarch_kernel import Actor, current_rank, endpoint
from monarch_kernel.job import SlurmJob


class Where(Actor):
    @endpoint
    def where(self) -> str:
        return (f"rank {current_rank().rank}: {socket.gethostname()}, Slurm job {os.environ['SLURM_JOB_ID']}, "
                f"pid {os.getpid()}")


started = time.monotonic()
job = SlurmJob(meshes={"trainers": 2}, partition="mk", login=LOGIN, ssh_args=SSH_ARGS, python_exe=PYTHON,
               time_limit="00:10:00")
procs = job.state().trainers.spawn_procs(per_host={"gpus": 2})
answers = procs.spawn("where", Where).where.call().get(timeout=60)
print(f"{procs.extent} on {job.nodes}, through {LOGIN.split('@')[1]}: first answers "
      f"{time.monotonic() - started:.1f} s after SlurmJob()")
for line in answers.values():
    print(line)
job.kill()                              # scancel, over the same ssh connection
'''


def where_and_when() -> str:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.node()} (Linux "
            f"{platform.release()}, {os.cpu_count()} cores{f', {cpu}' if cpu else ''}, Python "
            f"{platform.python_version()})")


def run_script(name: str, prelude: str, code: str, folder: str) -> str:
    """Run ``prelude + code`` as ``python NAME.py`` in ``folder``; what it printed."""
    script = os.path.join(folder, f"{name}.py")
    with open(script, "w") as f:
        f.write(prelude + code)
    ran = subprocess.run([sys.executable, script], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'extension'}"))
    if ran.returncode != 0:
        raise RuntimeError(f"{name}.py exited {ran.returncode}:\n{ran.stdout}")
    return ran.stdout.rstrip()


def page(how: str, blocks: list[tuple[str, str]]) -> str:
    """The included text: a note saying where, when and how, then the blocks (language, text)."""
    body = "\n\n".join(f"```{lang}\n{text.rstrip()}\n```" for lang, text in blocks)
    return f"""\
% Written by docs/_recorded/record.py: run it again rather than editing this file.

:::{{admonition}} Recorded {where_and_when()}
:class: note

Not run when this site is built: {how}  `python docs/_recorded/record.py` records it again.
:::

{body}
"""


def record_ssh(hosts, folder: str) -> str:
    ssh_config_file(hosts, os.path.join(folder, "ssh_config"),
                    "".join(f"Host node{i + 1}\n  HostName {ip}\n" for i, ip in enumerate(hosts.hosts)))
    out = run_script("ssh", f"PYTHON = {checkout_python(folder)!r}\n", SSH, folder)
    how = (f"{HOSTS_NOTE}, which ssh reaches as `node1` and `node2` (their `Host` entries in `ssh_config`), "
           "ran it as a script; `PYTHON` is an interpreter with this checkout on its path.")
    return page(how, [("python", SSH), ("text", out)])


def _first_line(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """The first line of ``proc``'s stderr that matches ``pattern`` (the rest is drained)."""
    found: list[str] = []
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if not found and re.search(pattern, line):
                found.append(line.rstrip())
                ready.set()
        ready.set()  # it exited

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or not found:
        raise RuntimeError(f"no line matching {pattern!r} within {timeout} s (exit code {proc.poll()}):\n"
                           + "".join(seen))
    return found[0]


def record_workers(hosts, folder: str) -> str:
    python = checkout_python(folder)
    subprocess.run([python, "-m", "monarch_kernel", "key", "new", "mk-key"], cwd=folder, check=True, timeout=60)
    workers, said = [], []
    try:
        for i, ip in enumerate(hosts.hosts):  # as a scheduler would start them: one per host
            cmd = [python, "-m", "monarch_kernel.agent", "--listen", f"tcp://{ip}:29500", "--key-file", "mk-key"]
            enter = ["nsenter", "-t", str(hosts.sshd[i].pid), "-n", "-m", "-u", f"--wd={folder}", "--"]
            workers.append(subprocess.Popen([*enter, *cmd], cwd=folder, stderr=subprocess.PIPE, text=True))
            said.append(f"$ python -m monarch_kernel.agent --listen tcp://{ip}:29500 --key-file mk-key   # on "
                        f"mk-h{i + 1}\n{_first_line(workers[-1], 'listening on', 60)}")
        addresses = [f"tcp://{ip}:29500" for ip in hosts.hosts]
        out = run_script("workers", f"WORKERS = {addresses!r}\n", WORKERS, folder)
        for w in workers:
            w.wait(timeout=60)  # hosts.shutdown() ended them
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
                w.wait(timeout=30)
    how = (f"{HOSTS_NOTE}: a worker started in each (as a scheduler would), then a script attached to them; "
           f"`WORKERS` is `{addresses!r}`.")
    commands = "$ python -m monarch_kernel key new mk-key\n" + "\n".join(said)
    return page(how, [("text", commands), ("python", WORKERS), ("text", out)])


def record_slurm(cluster, folder: str) -> str:
    os.environ["SLURM_CONF"] = cluster.conf  # the clients (sbatch, squeue, srun) find the cluster by it
    out = run_script("slurm", "", SLURM, folder)
    how = (f"a Slurm 22.05 cluster on this machine (`slurmctld` and `munged` here, a `slurmd` in each of two "
           f"network namespaces, `mkn1` and `mkn2`, with {cluster.cpus} CPUs each: `tests/support/cluster.py`), "
           "its partition `mk`; the script ran where `sbatch` works, as on a login node.")
    return page(how, [("python", SLURM), ("text", out)])


def record_slurm_login(cluster, folder: str) -> str:
    with slurm_login(cluster) as login:
        prelude = (f"LOGIN = {login.login!r}\nSSH_ARGS = {tuple(login.hosts.ssh_args)!r}\n"
                   f"PYTHON = {checkout_python(folder)!r}\n")
        out = run_script("slurm_login", prelude, SLURM_LOGIN, folder)
        how = ("the same Slurm cluster as the example before, behind a login node: a network namespace with its "
               f"own sshd, on a network of its own with this process (`{login.laptop_ip}`, the laptop), which "
               "the compute nodes have no route to.  `LOGIN`, `SSH_ARGS` (the test key) and `PYTHON` (an "
               "interpreter with this checkout on its path) were set before it.")
    return page(how, [("python", SLURM_LOGIN), ("text", out)])


def main(names: list[str]) -> None:
    """Record ``names`` (all three by default)."""
    unknown = set(names) - {"ssh", "workers", "slurm", "slurm_login"}
    if unknown:
        raise SystemExit(f"record.py [ssh] [workers] [slurm] [slurm_login]: no example called "
                         f"{', '.join(sorted(unknown))}")
    names = names or ["ssh", "workers", "slurm", "slurm_login"]
    on_hosts = [(n, r) for n, r in (("ssh", record_ssh), ("workers", record_workers)) if n in names]
    if on_hosts:
        with ssh_network() as hosts, tempfile.TemporaryDirectory(prefix="mk-record-") as folder:
            for name, record in on_hosts:
                (Path(__file__).parent / f"{name}.md").write_text(record(hosts, folder))
                print(f"wrote docs/_recorded/{name}.md")
    on_slurm = [(n, r) for n, r in (("slurm", record_slurm), ("slurm_login", record_slurm_login)) if n in names]
    if not on_slurm:
        return
    with slurm_network() as cluster, tempfile.TemporaryDirectory(prefix="mk-record-") as folder:
        os.chmod(folder, 0o755)  # the jobs' steps run as this user, in this folder
        for name, record in on_slurm:
            (Path(__file__).parent / f"{name}.md").write_text(record(cluster, folder))
            print(f"wrote docs/_recorded/{name}.md")


if __name__ == "__main__":
    main(sys.argv[1:])
