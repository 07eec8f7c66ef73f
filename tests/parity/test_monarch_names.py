"""Monarch's public names that code ported with one import changed relies on: Accumulator,
current_actor_name, get_or_spawn_controller, shutdown_context, Actor.logger, the actor's
proc_mesh, generic meshes, flatten and size, bootstrap functions and other interpreters,
ProcMesh.logging_option, and a quiet exit.  Real ranks throughout; pure parts first."""

from __future__ import annotations

import asyncio
import inspect
import logging
import operator
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from monarch_kernel import (
    Accumulator,
    Actor,
    ActorError,
    ActorMesh,
    Future,
    HostMesh,
    MeshStopped,
    ProcessDied,
    ProcMesh,
    ValueMesh,
    context,
    current_actor_name,
    current_rank,
    endpoint,
    get_or_spawn_controller,
    shutdown_context,
    this_host,
)
from monarch_kernel.actor.shape import Extent, Shape
from monarch_kernel.runtime.context import MeshRef
from monarch_kernel.runtime.spawn.launch_config import LaunchConfig

pytestmark = pytest.mark.timeout(60)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- actors (ranks import this module)


class Store(Actor):
    def __init__(self, tag: str = "root"):
        self.tag = tag
        self.items: dict = {}

    @endpoint
    def put(self, key, value) -> None:
        self.items[key] = value

    @endpoint
    def get(self, key):
        return self.items[key]

    @endpoint
    def where(self) -> tuple:
        return os.getpid(), self.tag


class Worker(Actor):
    @endpoint
    def who(self) -> str:
        return current_actor_name()

    @endpoint
    def value(self) -> int:
        return current_rank().rank + 1

    @endpoint
    def read_store(self, name: str, key):
        store = get_or_spawn_controller(name, Store).get(timeout=20)
        return store.get.call_one(key).get(timeout=20), store.actor_id

    @endpoint
    async def read_store_async(self, name: str, key):
        store = await get_or_spawn_controller(name, Store)
        return await store.get.call_one(key)

    @endpoint
    def read_store_from_child_mesh(self, name: str, key):
        """Spawns a mesh of its own and asks from one of its ranks: a rank of a rank."""
        with this_host().spawn_procs(per_host={"sub": 1}) as child:
            return child.spawn("child", Worker).read_store.call_one(name, key).get(timeout=20)

    @endpoint
    def env(self, name: str):
        return os.environ.get(name)

    @endpoint
    def my_proc_mesh(self) -> tuple:
        inst = context().actor_instance
        pm = inst.proc_mesh
        return type(pm).__name__, pm.name, dict(pm.extent), dict(inst.proc.extent), len(inst.proc)

    @endpoint
    def message_point(self) -> dict:
        return dict(context().message_rank)

    @endpoint
    def log_to_stdout(self, text: str) -> None:
        out = logging.getLogger("to.stdout")
        if not out.handlers:  # the actor's own handler, as Monarch's users add them
            out.addHandler(logging.StreamHandler(sys.stdout))
            out.propagate = False
        out.warning(text)
        sys.stdout.flush()

    @endpoint
    def log(self, text: str) -> None:
        self.logger.info("own logger: %s", text)
        logging.getLogger("some.library").warning("library: %s", text)
        self.logger.debug("debug: %s", text)  # below WARNING: not forwarded by default


class Spawner(Actor):
    """A controller that asks for another controller from an async endpoint (Monarch's test)."""

    def __init__(self, tag: str = "none"):
        self.tag = tag

    @endpoint
    async def tag_of(self) -> str:
        return self.tag

    @endpoint
    async def spawn_other(self, name: str, tag: str) -> None:
        await get_or_spawn_controller(name, Spawner, tag=tag)


def set_env_from_rank() -> None:
    os.environ["MK_BOOTED"] = f"rank{current_rank().rank}"


async def set_env_async() -> None:
    await asyncio.sleep(0)
    os.environ["MK_BOOTED"] = "async"


def failing_bootstrap() -> None:
    raise ValueError("no accelerator on this rank")


@pytest.fixture
def procs():
    pm = this_host().spawn_procs(per_host={"gpus": 2})
    yield pm
    pm.stop().get(timeout=20)


def run_python(tmp_path, body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n" + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- pure


def test_flatten_and_size_without_processes():
    shape = Shape.full({"hosts": 2, "gpus": 3})
    flat = shape.flatten("rank")
    assert flat.extent == Extent({"rank": 6}) and flat.ranks == tuple(range(6))
    sub = shape.slice(gpus=slice(1, 3)).flatten("r")  # a sliced (strided) shape flattens too
    assert sub.extent == {"r": 4} and sub.ranks == (1, 2, 4, 5)
    with pytest.raises(TypeError, match="flatten takes the new dimension's name"):
        shape.flatten("")

    vm = ValueMesh(shape, list(range(6)))
    assert vm.size() == 6 and vm.size("gpus") == 3 and vm.size(("hosts", "gpus")) == 6
    assert vm.sizes == {"hosts": 2, "gpus": 3}
    with pytest.raises(KeyError, match="no dimension 'cpus'; its dimensions are hosts=2, gpus=3"):
        vm.size("cpus")
    fv = vm.flatten("rank")
    assert fv.extent == {"rank": 6} and list(fv.values()) == list(range(6))
    assert fv.slice(rank=4).item() == 4


def test_generic_meshes_and_logger():
    assert ActorMesh[Worker] is ActorMesh and ValueMesh[int] is ValueMesh  # the class itself, as Monarch's
    w = Worker()
    assert isinstance(w.logger, logging.Logger) and w.logger.name == "Worker"
    assert w.logger.level == logging.DEBUG and w.logger is w.logger


def test_launch_config_carries_bootstrap_and_job_ports():
    ref = MeshRef("m1", "gpus", (("gpus", 1),), ("ipc:///r/m1.0",), "ipc:///r/c", ("h",))
    cfg = LaunchConfig(b"k" * 32, "/r", "ipc:///r/c", 0, ref, ("/src",), "/src", {}, 8,
                       bootstrap=b"pickled", job_ports={"controllers": ("ipc:///r/c", 7)})
    assert LaunchConfig.from_wire(cfg.to_wire()) == cfg
    old = cfg.to_wire()
    del old["bootstrap"], old["job_ports"]  # a config from before these fields
    back = LaunchConfig.from_wire(old)
    assert back.bootstrap is None and back.job_ports == {}


def test_host_mesh_names():
    host = this_host()
    assert host.is_fake_in_process is False
    other = host.with_python_executable("/opt/env/bin/python")
    assert isinstance(other, HostMesh) and other is not host and "python='/opt/env/bin/python'" in repr(other)
    with pytest.raises(TypeError, match="path to an interpreter"):
        host.with_python_executable("")
    with pytest.raises(TypeError, match="bootstrap= takes a function"):
        host.spawn_procs(bootstrap="not a function")
    assert inspect.iscoroutinefunction(ProcMesh.logging_option)


def test_names_outside_an_actor():
    assert current_actor_name() == "client"
    pm = context().actor_instance.proc_mesh
    assert isinstance(pm, ProcMesh) and len(pm) == 1


# ---------------------------------------------------------------- actor API on real ranks


def test_accumulator_sync_and_awaited(procs):
    workers = procs.spawn("workers", Worker)
    acc = Accumulator(workers.value, 10, operator.add)
    fut = acc.accumulate()
    assert isinstance(fut, Future)
    assert fut.get(timeout=20) == 13  # 10 + 1 + 2

    async def main():
        return await Accumulator(workers.value, [], lambda a, v: [*a, v]).accumulate()

    assert asyncio.run(main()) == [1, 2]


def test_current_actor_name_differs_per_rank(procs):
    names = list(procs.spawn("workers", Worker).who.call().get(timeout=20).values())
    assert len(set(names)) == 2
    assert names[0].startswith("procs") and "[0]." in names[0] and "workers-" in names[0]


def test_actor_proc_mesh_and_proc(procs):
    answers = procs.spawn("workers", Worker).my_proc_mesh.call().get(timeout=20)
    for kind, name, extent, proc_extent, n in answers.values():
        assert (kind, name, extent, proc_extent, n) == ("ProcMesh", procs.name, {"gpus": 2}, {}, 1)


def test_flatten_and_size_on_meshes(procs):
    assert procs.size() == 2 and procs.size("gpus") == 2 and procs.sizes == {"gpus": 2}
    workers = procs.spawn("workers", Worker)
    flat = workers.flatten("rank")
    assert isinstance(flat, ActorMesh) and flat.extent == {"rank": 2} and flat.size("rank") == 2
    assert list(flat.message_point.call().get(timeout=20).values()) == [{"rank": 0}, {"rank": 1}]
    vm = workers.value.call().get(timeout=20).flatten("r")
    assert vm.slice(r=1).item() == 2


# ---------------------------------------------------------------- get_or_spawn_controller


def test_controller_is_one_per_job_from_any_process(procs):
    fut = get_or_spawn_controller("store-any", Store, tag="first")
    assert isinstance(fut, Future)
    store = fut.get(timeout=20)
    assert isinstance(store, ActorMesh)
    store.put.call_one("k", 41).get(timeout=20)
    again = get_or_spawn_controller("store-any", Store, tag="second").get(timeout=20)
    assert again.actor_id == store.actor_id
    assert again.where.call_one().get(timeout=20) == (os.getpid(), "first")  # hosted here, the root

    workers = procs.spawn("workers", Worker)
    answers = workers.read_store.call("store-any", "k").get(timeout=30)
    assert list(answers.values()) == [(41, store.actor_id), (41, store.actor_id)]
    assert list(workers.read_store_async.call("store-any", "k").get(timeout=30).values()) == [41, 41]
    # From a rank of a mesh a rank spawned: still the root's singleton.
    value, actor_id = workers.slice(gpus=1).read_store_from_child_mesh.call_one("store-any", "k").get(timeout=40)
    assert (value, actor_id) == (41, store.actor_id)


def test_controller_asked_for_from_inside_a_controller():
    first = get_or_spawn_controller("spawner-1", Spawner).get(timeout=20)
    first.spawn_other.call_one("spawner-2", "from spawner-1").get(timeout=20)
    second = get_or_spawn_controller("spawner-2", Spawner).get(timeout=20)
    assert second.tag_of.call_one().get(timeout=20) == "from spawner-1"


def test_controller_argument_errors():
    with pytest.raises(TypeError, match="takes an Actor class"):
        get_or_spawn_controller("x", Store())


# ---------------------------------------------------------------- bootstrap and interpreters


def test_bootstrap_runs_on_each_rank_before_actors():
    with this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=set_env_from_rank) as pm:
        env = pm.spawn("workers", Worker).env.call("MK_BOOTED").get(timeout=20)
        assert list(env.values()) == ["rank0", "rank1"]
    with this_host().spawn_procs(per_host={"gpus": 1}, bootstrap=set_env_async) as pm:
        assert pm.spawn("workers", Worker).env.call_one("MK_BOOTED").get(timeout=20) == "async"


def test_bootstrap_that_raises_fails_the_spawn_with_its_traceback():
    with pytest.raises(ActorError) as info:
        this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=failing_bootstrap)
    text = str(info.value)
    assert "the bootstrap function of mesh 'procs" in text and "ValueError: no accelerator on this rank" in text
    assert "in failing_bootstrap" in text  # the rank's traceback
    assert isinstance(info.value.__cause__, ValueError)


def test_with_python_executable_starts_ranks_with_that_interpreter(tmp_path):
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\nexport MK_WRAPPED=yes\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    with this_host().with_python_executable(str(wrapper)).spawn_procs(per_host={"gpus": 2}) as pm:
        assert list(pm.spawn("workers", Worker).env.call("MK_WRAPPED").get(timeout=20).values()) == ["yes", "yes"]
    with this_host().spawn_procs(per_host={"gpus": 1}) as pm:  # the default interpreter is untouched
        assert pm.spawn("workers", Worker).env.call_one("MK_WRAPPED").get(timeout=20) is None


def test_an_interpreter_that_cannot_start_ranks_fails_fast(tmp_path):
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'this interpreter has no monarch_kernel' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ProcessDied, match=f"the template running {broken} exited before forking it"):
        this_host().with_python_executable(str(broken)).spawn_procs(per_host={"gpus": 2}, timeout=20)
    with pytest.raises(FileNotFoundError):
        this_host().with_python_executable(str(tmp_path / "missing")).spawn_procs(timeout=20)


# ---------------------------------------------------------------- logging, shutdown, exit


def test_logging_option_is_a_coroutine_and_sets_the_forwarded_level(tmp_path):
    done = run_python(tmp_path, """
        import asyncio, logging, time
        from test_monarch_names import Worker
        from monarch_kernel import this_host

        procs = this_host().spawn_procs(per_host={"gpus": 2})
        workers = procs.spawn("workers", Worker)
        workers.log.call("default").get(timeout=20)
        asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=3, level=logging.ERROR))
        workers.log.call("at-error").get(timeout=20)
        asyncio.run(procs.logging_option(stream_to_client=False))
        workers.log.call("not-streamed").get(timeout=20)
        asyncio.run(procs.logging_option(level=logging.DEBUG))
        workers.log.call("at-debug").get(timeout=20)
        workers.log_to_stdout.call("through its own handler").get(timeout=20)
        try:
            asyncio.run(procs.logging_option(level=1000))
        except ValueError as e:
            print(f"refused: {e}", flush=True)  # one write: a rank's line may come between two
        procs.stop().get(timeout=20)  # the ranks' last lines have reached this process when it returns
    """)
    err = done.stderr
    assert done.returncode == 0, err
    assert "refused: Invalid logging level: 1000" in done.stdout
    for rank in (0, 1):
        # Before logging_option: as on a plain Python, WARNING and up, the message alone.
        assert f"[rank {rank}] library: default\n" in err, err
        # Streamed (logging_option): at the level asked, with Monarch's prefix, under the controller's label.
        prefix = f"[rank {rank}] [actor=<root>.<test_monarch_names.Worker workers{{'gpus': {rank}/2}}>]"
        assert f"{prefix} INFO Worker: own logger: at-debug" in err, err
        assert f"{prefix} DEBUG Worker: debug: at-debug" in err, err
        assert f"{prefix} through its own handler" in done.stdout, done.stdout  # the actor's own handler too
    assert "own logger: default" not in err and "debug: default" not in err  # INFO, DEBUG: not by default
    assert "at-error" not in err and "not-streamed" not in err


def test_shutdown_context_stops_every_mesh():
    a = this_host().spawn_procs(per_host={"gpus": 2})
    b = this_host().spawn_procs(per_host={"gpus": 1})
    workers = b.spawn("workers", Worker)
    assert workers.value.call_one().get(timeout=20) == 1
    shutdown_context().get(timeout=20)
    assert a.dead_ranks() == [0, 1] and b.dead_ranks() == [0]
    with pytest.raises(MeshStopped):
        workers.value.call_one().get(timeout=20)
    with this_host().spawn_procs(per_host={"gpus": 1}) as c:  # spawning afterwards still works
        assert c.spawn("workers", Worker).value.call_one().get(timeout=20) == 1


@pytest.mark.parametrize("ending", ["returns", "raises"])
def test_a_script_that_never_stops_its_mesh_exits_quietly(tmp_path, ending):
    done = run_python(tmp_path, f"""
        from test_monarch_names import Worker
        from monarch_kernel import this_host

        procs = this_host().spawn_procs(per_host={{"gpus": 3}})
        print(list(procs.spawn("workers", Worker).value.call().get(timeout=20).values()), flush=True)
        if {ending == "raises"}:
            raise RuntimeError("the script failed")
    """)
    assert "[1, 2, 3]" in done.stdout, done.stderr
    assert "unhandled failure" not in done.stderr and "signal 9" not in done.stderr, done.stderr
    if ending == "raises":
        assert done.returncode == 1 and "RuntimeError: the script failed" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
