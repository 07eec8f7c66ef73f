"""The Makefile's system packages: `make setup` and `make test` install only what dpkg does not
list as installed, never upgrade an installed package (`apt-get install libssl-dev` with it
installed once upgraded libssl3 and openssl), and print one line a step, apt's own output only
when it fails.  The recipes run for real, with stand-ins for apt-get, dpkg-query and id on PATH
(the Makefile calls them by name): nothing is installed, the stand-ins record what was asked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.checkout_copy import ROOT, user_env

pytestmark = pytest.mark.timeout(60)

# Both sets of system packages, as the Makefile names their stamps (VENV= puts them in a temp dir),
# read after the Makefile.
STEPS = "apt-steps: $(SYSSTAMP) $(TEST_SYSSTAMP)\n"
TEST_SYSDEPS = ["iproute2", "libibverbs-dev", "rdma-core", "python3-pyverbs", "chromium", "openssh-server",
                "openssh-client", "slurmctld", "slurmd", "slurm-client", "munge"]
STANDINS = {
    # records its arguments; APT_FAILS makes `install` fail with apt's kind of output
    "apt-get": '#!/bin/sh\necho "$*" >> "$(dirname "$0")/apt-get.log"\n'
               'case "$1 $APT_FAILS" in "install 1") echo "E: Unable to locate package munge" >&2; exit 100;; esac\n'
               'echo "Reading package lists... Done"\n',
    # a package is installed when INSTALLED names it, as dpkg-query -W -f '${db:Status-Status}' says
    "dpkg-query": '#!/bin/sh\neval pkg=\\${$#}\ncase " $INSTALLED " in *" $pkg "*) echo installed;;\n'
                  '*) echo "dpkg-query: no packages found matching $pkg" >&2; exit 1;; esac\n',
    "id": "#!/bin/sh\necho 0\n",  # root, whoever runs the tests
}


def apt_steps(tmp_path: Path, installed: list[str], fails: bool = False) -> tuple[subprocess.CompletedProcess, list]:
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name, text in STANDINS.items():
        (tools / name).write_text(text)
        (tools / name).chmod(0o755)
    env = dict(user_env(tools), INSTALLED=" ".join(installed), APT_FAILS="1" if fails else "")
    (tmp_path / "steps.mk").write_text(STEPS)
    done = subprocess.run(["make", "-f", "Makefile", "-f", str(tmp_path / "steps.mk"), f"VENV={tmp_path / 'venv'}",
                           "apt-steps"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=50)
    log = tools / "apt-get.log"
    return done, (log.read_text().splitlines() if log.exists() else [])


def test_installed_packages_are_not_touched(tmp_path):
    done, calls = apt_steps(tmp_path, ["libssl-dev", *TEST_SYSDEPS])
    assert done.returncode == 0, done.stderr
    assert calls == []
    assert done.stdout.splitlines() == ["system packages: already installed: libssl-dev",
                                        "system packages: already installed: " + " ".join(TEST_SYSDEPS)]
    assert done.stderr == ""


def test_only_missing_packages_are_installed_without_upgrading_any(tmp_path):
    done, calls = apt_steps(tmp_path, ["libssl-dev", *TEST_SYSDEPS[:4], *TEST_SYSDEPS[5:-1]])
    assert done.returncode == 0, done.stderr
    assert calls == ["update -qq", "install -y -qq --no-upgrade chromium munge"]
    assert done.stdout.splitlines() == ["system packages: already installed: libssl-dev",
                                        "apt-get install --no-upgrade chromium munge"]
    assert "Reading package lists" not in done.stdout + done.stderr  # apt's chatter stays out


def test_a_failed_install_shows_apt_output_and_stops(tmp_path):
    done, calls = apt_steps(tmp_path, [], fails=True)
    assert done.returncode != 0
    assert calls == ["update -qq", "install -y -qq --no-upgrade libssl-dev"]
    assert "E: Unable to locate package munge" in done.stderr
    assert "error: apt-get install libssl-dev failed (its output is above)" in done.stderr
