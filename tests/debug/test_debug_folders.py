"""The debugger's cell folder (``$TMPDIR/ipykernel_<kernel pid>``, a name anyone can compute) made
first by another user (uid 65534), in a shared sticky folder as /tmp is: the debugger must
neither write cells where that user reads them nor follow the link they planted at a cell's
path to overwrite a file of the notebook user's.  Without the other user, cells are 0600."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
from support.dap import INITIALIZE, Session, start_debugger
from support.kernels import kernel
from support.other_user import NOBODY, SYSTEM_PYTHON, shared_folder
from support.other_user import needs_other_users as _needs_other_users

pytestmark = pytest.mark.timeout(150)

SECRET_CELL = "api_key = 'sk-not-for-others'\nprint(len(api_key))"
LINKED_CELL = "x = 'written through the link'\nprint(x)"


@pytest.fixture
def shared_tmp():
    with shared_folder() as path:
        yield path


def _cell_name(code: str) -> str:
    from ipykernel.compiler import get_tmp_hash_seed, murmur2_x86

    return f"{murmur2_x86(code, get_tmp_hash_seed())}.py"


def _premade(folder: str, victim: str) -> None:
    """As the other user: make the cell folder open to all, with a link at a cell's path."""
    code = (f"import os; os.mkdir({folder!r}); os.chmod({folder!r}, 0o777); "
            f"os.symlink({victim!r}, os.path.join({folder!r}, {_cell_name(LINKED_CELL)!r}))")
    subprocess.run([*NOBODY, SYSTEM_PYTHON, "-c", code], check=True, timeout=30)


def _read_as_other_user(folder: str) -> str:
    code = (f"import os\nfor n in os.listdir({folder!r}):\n    try:\n"
            f"        print(open(os.path.join({folder!r}, n)).read())\n    except OSError:\n        pass")
    ran = subprocess.run([*NOBODY, SYSTEM_PYTHON, "-c", code], capture_output=True, text=True, timeout=30)
    return ran.stdout


def _victim(tmp_path) -> str:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = private / "only-mine"
    victim.write_text("untouched")
    return str(victim)


@pytest.mark.parametrize("where", ["kernel", "rank"])
def test_a_cell_folder_another_user_made_is_not_used(kernelspec, shared_tmp, tmp_path, where):
    _needs_other_users()
    victim = _victim(tmp_path)
    with kernel(kernelspec, env={**os.environ, "TMPDIR": shared_tmp}) as client:
        s = Session(client)
        pid = int(s.cell("import os\nos.getpid()").split()[-1])
        folder = os.path.join(shared_tmp, f"ipykernel_{pid}")
        _premade(folder, victim)
        if where == "rank":
            assert "now debugs rank 0" in s.cell("procs = %mesh spawn -n 1\n%mesh debug 0")
        started = s.dap("initialize", INITIALIZE)
        if where == "kernel":
            # The panel is told why: the folder is not the user's.
            assert not started["success"] and f"{folder} is a folder of uid 65534" in started["message"], started
        else:
            assert started["success"], started
            assert s.dap("attach", {})["success"]
        for code in (SECRET_CELL, LINKED_CELL):
            dumped = s.dap("dumpCell", {"code": code})
            if where == "rank":
                assert not dumped["success"] and "uid 65534" in dumped["message"], dumped
        if where == "rank":
            assert "[rank 0] 17" in s.cell("%%mesh\n" + SECRET_CELL)  # cells still run
            s.dap("disconnect", {"restart": False, "terminateDebuggee": False})
    assert "sk-not-for-others" not in _read_as_other_user(folder)
    with open(victim) as f:
        assert f.read() == "untouched"


def test_cells_written_for_the_debugger_are_0600_in_a_0700_folder(kernelspec, shared_tmp):
    with kernel(kernelspec, env={**os.environ, "TMPDIR": shared_tmp}) as client:
        s = Session(client)
        start_debugger(s)
        path = s.dap("dumpCell", {"code": SECRET_CELL})["body"]["sourcePath"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, oct(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        s.dap("disconnect", {"restart": False, "terminateDebuggee": False})
