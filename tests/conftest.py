"""Shared fixtures.  Every process a test starts must be gone when it ends: a per-test
check waits a few seconds for new rank processes to exit, and a session-wide check fails
the run if any process of this test session (marked through the environment) is left.
Kernel fixtures (``kernelspec``, ``kc``, ``module_kc``, ``ipython_kc``) start real kernels
through jupyter_client; their helpers, and the one IOPub collector, are in ``_kernels.py``.
Simulated hosts (``ssh_hosts``, ``slurm_cluster``: network namespaces) are in ``cluster.py``."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid

import psutil
import pytest
from cluster import slurm_cluster, slurm_cluster_session, ssh_hosts, ssh_hosts_session  # noqa: F401  (fixtures)

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
        return "template_server import serve" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _describe(procs) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"pid {p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            out.append(f"pid {p.pid}")
    return "\n".join(out)


def _kill(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _wait_gone(procs, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if alive:
            time.sleep(0.05)
    return alive


@pytest.fixture(autouse=True)
def no_leftover_ranks():
    """Rank processes (and controllers) a test started must end with the test."""
    before = {p.pid for p in _marked_processes()}
    yield
    new = [p for p in _marked_processes() if p.pid not in before and not _is_template(p)]
    left = _wait_gone(new, 10.0)
    if left:
        _kill(left)
        pytest.fail("processes started by this test outlived it:\n" + _describe(left))


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    yield
    from monarch_kernel.runtime.process import Runtime

    if Runtime._current is not None:
        Runtime._current.shutdown()
    left = _wait_gone(_marked_processes(), 10.0)
    shutil.rmtree(_USER_DIRS, ignore_errors=True)
    if left:
        _kill(left)
        pytest.fail("processes outlived the test session:\n" + _describe(left), pytrace=False)


# ---------------------------------------------------------------- real kernels
# _kernels is imported inside the fixtures: importing it imports the kernel package, which
# tests of the lower layers never need.


@pytest.fixture(scope="session")
def kernelspec() -> str:
    """The monarch kernelspec's name, installed into this environment if it is missing."""
    from _kernels import ensure_kernelspec

    return ensure_kernelspec()


@pytest.fixture
def kc(kernelspec):
    """A client of a fresh monarch kernel, shut down (and waited for) after the test."""
    from _kernels import kernel

    with kernel(kernelspec) as client:
        yield client


@pytest.fixture(scope="module")
def module_kc(kernelspec):
    """One monarch kernel shared by the tests of a module, shut down after the last."""
    from _kernels import kernel

    with kernel(kernelspec) as client:
        yield client


@pytest.fixture
def ipython_kc():
    """A client of a fresh plain IPython kernel (``python3``), shut down after the test."""
    from _kernels import kernel

    with kernel("python3") as client:
        yield client


# ---------------------------------------------------------------- parallel workers
# `make test` runs the suite on two workers (pytest-xdist, ``--dist loadgroup``): each module
# is one unit of work, so its module-scoped meshes and kernels stay on one worker, and the
# modules that share a simulated cluster (a session fixture) are one unit together.  Units
# start longest first, so the two workers finish at about the same time.

CLUSTER_MODULES = {"test_cluster", "test_hosts", "test_hosts_kernel", "test_slurm", "test_debug_tunnel"}
# Seconds each of the slowest modules took in a serial run on 2 cores; a module not named here
# counts as short.  Only the order of the units depends on them.
SLOW_MODULES = {
    "test_chaos": 220, "test_scale": 120, "test_kernel": 90, "test_hosts": 80, "test_slurm": 60, "test_cluster": 30,
    "test_hosts_kernel": 40, "test_debug_tunnel": 40, "test_panel_lab": 60, "test_jupyterlab": 60,
    "test_notebooks": 60, "test_tensors": 60, "test_tensor_collectives": 50, "test_debug": 60,
    "test_spmd": 60, "test_data": 50, "test_monarch_names": 50, "test_panel": 50, "test_stacks": 40,
    "test_profile": 40, "test_lifecycle": 40, "test_spmd_kernel": 40, "test_monarch_examples": 40,
    "test_packaging": 100, "test_server_api": 50, "test_fuzz_wires": 30, "test_wire_limits": 30,
    "test_output": 30, "test_leaks": 30, "test_workspace": 30, "test_liveness": 30,
}


def _module(item) -> str:
    return item.nodeid.partition("::")[0].rpartition("/")[2].removesuffix(".py")


def _unit(item) -> str:
    return "cluster" if _module(item) in CLUSTER_MODULES else _module(item)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "numprocesses", None):
        return  # a serial run keeps pytest's order
    weight: dict[str, float] = {}
    for module, unit in {_module(i): _unit(i) for i in items}.items():
        weight[unit] = weight.get(unit, 0.0) + SLOW_MODULES.get(module, 0.0)
    first = {u: n for n, u in enumerate(dict.fromkeys(_unit(i) for i in items))}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
    items.sort(key=lambda i: (-weight[_unit(i)], first[_unit(i)]))  # stable: each module keeps its order
