"""The one configuration module (``runtime/config.py``) and diagnostics through ``logging``.

Every environment variable and timing constant is declared there and read from there (checked
from the source); the documentation's tables are the module's own (tests/docs/ checks the built
page); a kernel setting given as a ``MeshKernel`` traitlet (command line, or a config file in a
Jupyter config directory) is the value the kernel and its ranks use; diagnostics are
``monarch_kernel`` log records that reach stderr unless the program configured logging, and
importing the package installs no handler.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
from support.config import configured
from support.kernels import kernel, run

from monarch_kernel.runtime import config

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "monarch_kernel").rglob("*.py"), *(ROOT / "extension").rglob("*.py")])
CONFIG = ROOT / "monarch_kernel" / "runtime" / "config.py"
READ_MARK = "(cell that reads the settings)"
READ_CELL = ("from monarch_kernel.runtime import config\n"
             f"print({READ_MARK!r}, config.heartbeat_timeout(), config.fanout(), config.spawn_timeout())")


def _others():
    for path in SOURCES:
        if path != CONFIG:
            yield path.relative_to(ROOT), path.read_text()


# ---------------------------------------------------------------- one module declares them all


def test_the_settings_command_prints_the_documentations_tables():
    out = subprocess.run([sys.executable, "-m", "monarch_kernel", "settings", "--markdown"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == config.markdown() and not out.stderr


def test_no_module_but_config_reads_a_variable_of_ours():
    read = re.compile(r"""(environ(\.get)?\s*[(\[]|getenv\s*\()\s*["']MONARCH_KERNEL_""")
    offenders = [f"{rel}:{n}" for rel, src in _others() for n, line in enumerate(src.splitlines(), 1)
                 if read.search(line)]
    assert offenders == [], "read these through monarch_kernel.runtime.config instead"


def test_every_variable_the_code_names_is_declared():
    declared = {s.env for s in config.SETTINGS.values() if s.env}
    named = {m for _, src in _others() for m in re.findall(r"MONARCH_KERNEL_[A-Z][A-Z_]*[A-Z]", src)}
    assert named - declared == set(), "declare these in runtime/settings.py (name, type, default, meaning)"
    assert len(declared) == 39  # 33, and the history's six (issue 45: its run, one spawn's folder)


def test_every_timing_constant_comes_from_config():
    defined = re.compile(r"^\s*_?[A-Z][A-Z0-9_]*_S\s*=(.*)$")
    offenders = [f"{rel}:{n}: {line.strip()}" for rel, src in _others()
                 for n, line in enumerate(src.splitlines(), 1)
                 if (m := defined.match(line)) and "seconds(" not in m.group(1)]
    assert offenders == [], "declare these in runtime/settings.py and read them with config.seconds(name)"


def test_every_constant_is_used_where_the_table_says():
    for s in config.SETTINGS.values():
        if s.env is None:
            package = "extension" if s.used_in.startswith("monarch_kernel_server/") else "monarch_kernel"
            path = ROOT / package / s.used_in
            assert f'seconds("{s.name}")' in path.read_text(), f"{s.name} is not read in {s.used_in}"


def test_a_given_value_wins_over_the_variable_which_wins_over_the_default(monkeypatch):
    monkeypatch.delenv("MONARCH_KERNEL_HEARTBEAT_TIMEOUT", raising=False)
    assert config.heartbeat_timeout() == 10.0 and config.exported_env() == {}
    monkeypatch.setenv("MONARCH_KERNEL_HEARTBEAT_TIMEOUT", "2.5")
    assert config.heartbeat_timeout() == 2.5
    try:
        config.set("heartbeat_timeout", 7)
        config.set("strict", True)
        assert config.heartbeat_timeout() == 7.0 and config.strict() is True
        # What the ranks this process spawns get, as the variables they read.
        assert config.exported_env() == {"MONARCH_KERNEL_HEARTBEAT_TIMEOUT": "7.0", "MONARCH_KERNEL_STRICT": "1"}
    finally:
        config.set("heartbeat_timeout", None)
        config.set("strict", None)
    assert config.heartbeat_timeout() == 2.5 and config.exported_env() == {}
    with pytest.raises(ValueError, match=r"^agent_beat is a constant of the code \(runtime/spawn/agent_channel.py\)"):
        config.set("agent_beat", 1)
    with pytest.raises(KeyError, match="no setting named 'heartbeat'"):
        config.get("heartbeat")
    monkeypatch.setenv("MONARCH_KERNEL_FANOUT", "0")
    assert config.fanout() == 1  # the minimum


def test_configured_gives_each_setting_back_as_it_was():
    """The tests' ``configured(**settings)``: nested, it gives back the outer value; a constant
    named is refused before anything is given."""
    with configured(heartbeat_timeout=1.5, strict=True):
        assert config.heartbeat_timeout() == 1.5 and config.strict() is True
        with configured(heartbeat_timeout="3"):
            assert config.heartbeat_timeout() == 3.0
        assert config.heartbeat_timeout() == 1.5 and config.given("heartbeat_timeout") == 1.5
    assert config.given("heartbeat_timeout") is None and config.given("strict") is None
    with pytest.raises(ValueError, match="agent_beat is a constant of the code"), configured(fanout=3, agent_beat=1):
        pass
    assert config.given("fanout") is None


def test_every_kernel_setting_is_a_configurable_meshkernel_trait():
    from monarch_kernel.kernel.kernel import MeshKernel

    traits = MeshKernel.class_traits(config=True)
    for s in config.kernel_settings():
        assert s.name in traits, f"MeshKernel has no trait {s.name}: add `{s.name} = _setting({s.name!r})`"
        assert s.env in traits[s.name].help and s.help in traits[s.name].help
    assert {s.name for s in config.kernel_settings()} >= {"heartbeat_timeout", "spawn_timeout", "fanout",
                                                          "max_frame", "bind_address"}


# ---------------------------------------------------------------- kernels given settings


def _values(ran) -> str:
    line = next((x for x in ran.text.splitlines() if x.startswith(READ_MARK)), None)
    assert line is not None and ran.reply["status"] == "ok", ran.text
    return line[len(READ_MARK):].strip()


def test_a_kernel_given_a_setting_on_its_command_line_uses_it_and_its_ranks_too(kernelspec):
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_KERNEL_HEARTBEAT_TIMEOUT"}
    with kernel(kernelspec, extra_arguments=["--MeshKernel.heartbeat_timeout=7"], env=env) as kc:
        assert _values(run(kc, READ_CELL)) == "7.0 8 60.0"
        # Given as a traitlet, it wins over a variable set later; the ranks get it too.
        run(kc, "%env MONARCH_KERNEL_HEARTBEAT_TIMEOUT=1.5")
        assert _values(run(kc, READ_CELL)) == "7.0 8 60.0"
        assert run(kc, "procs = %mesh spawn -n 2").reply["status"] == "ok"
        out = run(kc, "%%mesh\nfrom monarch_kernel.runtime import config\nconfig.heartbeat_timeout()")
        assert "[ranks 0-1] 7.0" in out.text, out.text
        run(kc, "get_ipython().kernel.heartbeat_timeout = None")  # back to the variable
        assert _values(run(kc, READ_CELL)) == "1.5 8 60.0"
        run(kc, "%mesh stop")


def test_a_kernel_reads_its_settings_from_a_jupyter_config_directory(kernelspec, tmp_path):
    (tmp_path / "monarch_kernel_config.py").write_text("c.MeshKernel.heartbeat_timeout = 4.5\n")
    (tmp_path / "jupyter_config.json").write_text(json.dumps({"MeshKernel": {"fanout": 3, "spawn_timeout": 33}}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path), MONARCH_KERNEL_FANOUT="5")
    with kernel(kernelspec, env=env) as kc:
        assert _values(run(kc, READ_CELL)) == "4.5 3 33.0"
    # The command line wins over the files.
    with kernel(kernelspec, env=env, extra_arguments=["--MeshKernel.fanout=2"]) as kc:
        assert _values(run(kc, READ_CELL)) == "4.5 2 33.0"


# ---------------------------------------------------------------- diagnostics through logging


def test_a_kernels_diagnostics_reach_the_cell(kc):
    out = run(kc, "import logging\nlogging.getLogger('monarch_kernel.runtime.test').error('monarch_kernel: said')")
    assert [(o.name, o.text) for o in out.outputs] == [("stderr", "monarch_kernel: said\n")]


def _script(tmp_path, body: str) -> subprocess.CompletedProcess:
    path = tmp_path / "diagnose.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)


def test_importing_installs_no_handler_and_a_runtime_sends_diagnostics_to_stderr(tmp_path):
    out = _script(tmp_path, """
        import logging
        import monarch_kernel, monarch_kernel.kernel.kernel
        from monarch_kernel.runtime.process import Runtime
        log = logging.getLogger("monarch_kernel.runtime.test")
        print(logging.getLogger("monarch_kernel").handlers, logging.getLogger().handlers)
        log.error("before the runtime: logging's last resort")
        Runtime.current()
        log.error("monarch_kernel: said %s", "once")
        log.info("below the level: not said")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "[] []\n"
    assert out.stderr == "before the runtime: logging's last resort\nmonarch_kernel: said once\n"


def test_a_program_that_configures_logging_gets_the_diagnostics_once_in_its_own_format(tmp_path):
    out = _script(tmp_path, """
        import logging, sys
        logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
        from monarch_kernel.runtime.process import Runtime
        Runtime.current()
        logging.getLogger("monarch_kernel.runtime.test").error("monarch_kernel: said")
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ERROR monarch_kernel.runtime.test: monarch_kernel: said\n" and out.stderr == ""
