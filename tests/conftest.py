"""Shared fixtures.  Every process a test starts must be gone when it ends: a per-test
check waits a few seconds for new rank processes to exit, and a session-wide check fails
the run if any process of this test session (marked through the environment) is left.
Kernel fixtures (``kernelspec``, ``kc``, ``module_kc``, ``ipython_kc``) start real kernels
through jupyter_client; their helpers, and the one IOPub collector, are in ``support/kernels.py``.
Simulated hosts (``ssh_hosts``, ``slurm_cluster``, ``other_host``: network namespaces) are in
``support/cluster.py``."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
import time
import uuid

import psutil
import pytest
from support.cluster import (  # noqa: F401  (fixtures)
    LATE_S,
    WRITER_GRACE_S,
    is_exiting,
    is_history_writer,
    other_host,
    slurm_cluster,
    slurm_cluster_session,
    ssh_bare_hosts,
    ssh_hosts,
    ssh_hosts_session,
)

# Test modules sit in sub-folders that mirror the packages (tests/runtime/, tests/job/...), with
# no __init__.py: pytest imports each by its basename (unique across folders), its folder put
# first on sys.path ("prepend", pytest's default import mode), as tests/ is for this file.  So
# tests import what they share as ``support.NAME`` (the package tests/support/), and ranks, which
# inherit this sys.path, unpickle support's actors and a test module's own by module name.  No
# test module imports another (tests/system/test_layering.py checks it).

SESSION_MARK = "MONARCH_KERNEL_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, uuid.uuid4().hex)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs modules on parallel workers
    # each worker marks its own processes, so one worker's leak check never sees another's
    os.environ[SESSION_MARK] = f"{os.environ[SESSION_MARK].split('/')[0]}/{os.environ['PYTEST_XDIST_WORKER']}"
_MARK = os.environ[SESSION_MARK]

# Hermetic per-user state: Jupyter's and IPython's directories start empty in every run, as
# on a machine where Jupyter never ran (a developer's existing ~/.local/share/jupyter once
# hid a crash of `%mesh spawn --detach` on fresh machines).  Set at import, before any
# kernel or server is started, so every process the tests start inherits them.
_USER_DIRS = tempfile.mkdtemp(prefix="mk-test-home-")
USER_DIR_VARS = {
    "JUPYTER_RUNTIME_DIR": os.path.join(_USER_DIRS, "jupyter-runtime"),
    "JUPYTER_DATA_DIR": os.path.join(_USER_DIRS, "jupyter-data"),
    "JUPYTER_CONFIG_DIR": os.path.join(_USER_DIRS, "jupyter-config"),
    "IPYTHONDIR": os.path.join(_USER_DIRS, "ipython"),
    "MPLCONFIGDIR": os.path.join(_USER_DIRS, "matplotlib"),
    "XDG_STATE_HOME": os.path.join(_USER_DIRS, "state"),  # the meshes' histories, hang reports
}
os.environ.update(USER_DIR_VARS)  # the directories themselves do not exist yet, on purpose


def _marked_processes() -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(SESSION_MARK) == _MARK and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _is_template(p: psutil.Process) -> bool:
    try:
        return "template.server import serve" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _describe(procs) -> str:
    """Each process as it is now (before it is killed: afterwards there is nothing to read)."""
    out = []
    for p in procs:
        try:
            with p.oneshot():
                out.append(f"pid {p.pid} ({p.name()}, {p.status()}, parent {p.ppid()}): "
                           f"{' '.join(p.cmdline())[:160] or '(no command line: in its exit)'}")
        except psutil.ZombieProcess:
            out.append(f"pid {p.pid} (ended, not yet reaped by its parent {_parent(p)})")
        except psutil.Error as e:
            out.append(f"pid {p.pid} ({type(e).__name__})")
    return "\n".join(out)


def _parent(p: psutil.Process) -> str:
    try:
        parent = psutil.Process(p.ppid())
        return f"{parent.pid}: {' '.join(parent.cmdline())[:120]}"
    except psutil.Error:
        return "(gone)"


def _kill(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        if alive:
            time.sleep(0.05)
    return alive


@pytest.fixture(autouse=True)
def no_leftover_ranks():
    """Rank processes (and controllers) a test started must end with the test.  A controller's
    history writer outlives it by design until it has written what it was given (loading
    pyarrow first, slow on a loaded machine): it gets a minute more, and must then be gone too."""
    before = {p.pid for p in _marked_processes()}
    yield
    new = [p for p in _marked_processes() if p.pid not in before and not _is_template(p)]
    left = _wait_gone(new, 10.0)
    # Writers, and processes already in their exit (a SCHED_IDLE writer tearing down on a
    # loaded machine shows no command line for a while), are given the writers' minute.
    writers = [p for p in left if is_history_writer(p) or is_exiting(p.pid)]
    if writers:
        left = [p for p in left if p not in writers] + _wait_gone(writers, WRITER_GRACE_S)
    if left:
        # Described while they are alive, then one more look: one that ends of itself now was
        # slow to go on a loaded machine (fresh14: it ended as it was described), not left.
        said = {p.pid: _describe([p]) for p in left}
        left = _wait_gone(left, LATE_S)
    if left:
        _kill(left)
        pytest.fail("processes started by this test outlived it:\n" + "\n".join(said[p.pid] for p in left))


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    yield
    from monarch_kernel.runtime.process import Runtime

    if Runtime._current is not None:
        Runtime._current.shutdown()
    left = _wait_gone(_marked_processes(), 10.0)
    shutil.rmtree(_USER_DIRS, ignore_errors=True)
    if left:
        said = _describe(left)
        _kill(left)
        pytest.fail("processes outlived the test session:\n" + said, pytrace=False)


# ---------------------------------------------------------------- real kernels
# support.kernels is imported inside the fixtures: importing it imports the kernel package, which
# tests of the lower layers never need.


@pytest.fixture(scope="session")
def kernelspec() -> str:
    """The monarch kernelspec's name, installed into this environment if it is missing."""
    from support.kernels import ensure_kernelspec

    return ensure_kernelspec()


@pytest.fixture
def kc(kernelspec):
    """A client of a fresh monarch kernel, shut down (and waited for) after the test."""
    from support.kernels import kernel

    with kernel(kernelspec) as client:
        yield client


@pytest.fixture(scope="module")
def module_kc(kernelspec):
    """One monarch kernel shared by the tests of a module, shut down after the last."""
    from support.kernels import kernel

    with kernel(kernelspec) as client:
        yield client


@pytest.fixture(scope="session")
def executed_notebooks(tmp_path_factory) -> pathlib.Path:
    """Where tests/system/test_notebooks.py keeps each notebook it ran clean (its outputs), for
    the docs build of tests/docs/test_site.py, on the same worker, to take instead of running
    the notebooks a second time (``docs/_ext/mk_executed.py``).  Empty when they did not run."""
    return tmp_path_factory.mktemp("executed-notebooks")


@pytest.fixture
def ipython_kc():
    """A client of a fresh plain IPython kernel (``python3``), shut down after the test."""
    from support.kernels import kernel

    with kernel("python3") as client:
        yield client


# ---------------------------------------------------------------- parallel workers
# `make test` runs the suite on three workers (pytest-xdist, ``--dist loadgroup``): each module
# is one unit of work, so its module-scoped meshes and kernels stay on one worker, and the
# modules that share a simulated cluster (a session fixture) are one unit together, and so are
# the notebooks' tests and the docs site, whose build takes the notebooks those tests ran (the
# ``executed_notebooks`` fixture) instead of running them again.  Units start longest first,
# so the workers finish at about the same time.  (The units come
# from the scheduler below, not from ``xdist_group`` marks: under pytest 9 xdist cannot add
# a mark's group to a test's id, so its own loadgroup would send every test on its own.)

CLUSTER_MODULES = {"test_cluster", "test_hosts", "test_hosts_kernel", "test_slurm", "test_debug_tunnel",
                   "test_sync_env", "test_slurm_login", "test_remote_standby"}
# Seconds each of the slowest modules took; a module not named here counts as short.
# Only the order of the units depends on them.
SLOW_MODULES = {  # seconds each took in a fresh-clone run of `make test` (3 workers, 2 cores; MK_TEST_TIMELINE)
    # test_notebooks: its own `make setup` in a fresh copy (about 60 s unloaded, 240 s on a machine
    # loaded 10-fold) and removing it again, then the six notebooks (180 s unloaded)
    "test_notebooks": 400,
    # the docs site: its build runs the guides' cells, and takes the notebooks test_notebooks ran
    # (98 s beside it on a loaded 2-core machine; 279 s alone, running the notebooks itself)
    "test_site": 120,
    "test_elastic": 184, "test_kernel": 113, "test_hosts": 106, "test_panel": 89, "test_sync_env": 86,
    "test_chaos": 84, "test_panel_notes": 77, "test_panel_lab": 75, "test_hang": 68, "test_debug": 56,
    "test_stacks": 50, "test_data": 49, "test_slurm_login": 48, "test_history": 46, "test_debug_tunnel": 44,
    "test_jupyterlab": 37, "test_hang_kernel": 35, "test_spmd": 35, "test_slurm": 34, "test_rank_streams": 34,
    "test_cli": 31, "test_hostile": 30, "test_out_of_cluster": 29, "test_hosts_kernel": 29, "test_scale": 28,
    "test_attach": 28, "test_ssh_reach": 28, "test_spmd_kernel": 28, "test_executed_notebooks": 28,
    "test_cluster": 27, "test_packaging": 24, "test_tensors": 22, "test_debug_security": 21,
    "test_kernel_feedback": 20, "test_ipython_cells": 18, "test_caller": 18, "test_history_runs": 17,
    "test_restart_kernel": 16, "test_launcher": 15, "test_cli_history": 15, "test_datagram": 14,
    "test_profile": 14, "test_actor_loop": 14, "test_monarch_examples": 13, "test_restart_policy": 12,
    "test_history_kernel": 12, "test_remote_standby": 12, "test_leaks": 11, "test_actor_stop": 10, "test_shm": 10,
    "test_fast_path": 10, "test_debug_forward": 10, "test_stop_on_error": 10, "test_layering": 10,
    "test_tensor_rendezvous": 10, "test_rdma_compat": 9, "test_fuzz_wires": 9, "test_lifecycle": 9,
    "test_tensor_security": 8, "test_bad_input": 8, "test_bench_jump": 8,
}


# Modules that run in this order on one worker: the site's build reuses what the notebooks' tests ran.
DOCS_MODULES = ("test_notebooks", "test_site")


def _module(nodeid: str) -> str:
    return nodeid.partition("::")[0].rpartition("/")[2].removesuffix(".py")


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, "cluster" or "docs"."""
    module = _module(nodeid)
    return "cluster" if module in CLUSTER_MODULES else "docs" if module in DOCS_MODULES else module


def _docs_order(item) -> int:
    """The notebooks' tests before the site's (any other module: 0, it keeps its place)."""
    module = _module(item.nodeid)
    return DOCS_MODULES.index(module) if module in DOCS_MODULES else 0


def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadgroup``: xdist's scheduling by scope, a scope being a unit."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        # A serial run keeps pytest's order (workers collect; the controller schedules), but for
        # the notebooks' tests, which move before the site's (tests/docs/ sorts before tests/system/).
        docs = [i for i in items if _module(i.nodeid) in DOCS_MODULES]
        if docs:
            at = items.index(docs[0])
            rest = [i for i in items if _module(i.nodeid) not in DOCS_MODULES]
            items[:] = rest[:at] + sorted(docs, key=_docs_order) + rest[at:]
        return
    modules = {_module(i.nodeid): _unit(i.nodeid) for i in items}
    weight: dict[str, float] = {}
    for module, unit in modules.items():
        weight[unit] = weight.get(unit, 0.0) + SLOW_MODULES.get(module, 0.0)
    first = {u: n for n, u in enumerate(dict.fromkeys(_unit(i.nodeid) for i in items))}
    # stable: a module keeps its order, and so do a unit's modules, but for the docs unit's
    items.sort(key=lambda i: (-weight[_unit(i.nodeid)], first[_unit(i.nodeid)], _docs_order(i)))


def pytest_runtest_logfinish(nodeid, location):
    """``MK_TEST_TIMELINE=FILE``: each worker adds a line ``worker end-time nodeid`` as each test
    ends, to see how the units fell on the workers (and set ``SLOW_MODULES`` from a real run)."""
    path = os.environ.get("MK_TEST_TIMELINE")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {time.time():.1f} {nodeid}\n")
