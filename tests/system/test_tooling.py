"""The package's tooling: it ships its type information (PEP 561), and the lint that
``make test`` runs first is clean, so running pytest on its own catches the same findings.
Nothing here imports the package."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.timeout(60)

REPO = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_py_typed_is_in_the_package_and_its_data():
    assert (REPO / "monarch_kernel" / "py.typed").is_file()
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["monarch_kernel"]


def test_lint_tools_are_pinned_in_the_test_extra():
    extra = _pyproject()["project"]["optional-dependencies"]["test"]
    pinned = {req.split("==")[0] for req in extra if "==" in req}
    assert {"ruff", "mypy"} <= pinned


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(BIN)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (make test installs it with the test extra)")
    proc = subprocess.run([ruff, "check", "--no-cache", "monarch_kernel", "benchmarks", "examples", "tests"],
                          cwd=REPO, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, f"ruff found problems (fix them, or run `ruff check --fix`):\n{proc.stdout}"
