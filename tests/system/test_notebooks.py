"""Every notebook in notebooks/ runs top to bottom, clean, where ``make lab`` serves it: in a
fresh copy of this tree set up by its own ``make setup`` (its .venv, its kernelspec, the
notebooks extra; ``support/checkout_copy.py``), from the copy's workspace/, on that environment's monarch kernel,
never the test environment's.  Then ``make lab`` itself serves workspace/, and whatever the
session left (saved outputs, checkpoints, profiles) changes no file that git tracks.  Each
notebook that ran clean is kept (``executed_notebooks``) for the docs site's build, which runs
after this module on the same worker and shows those outputs instead of running it again."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from support.checkout_copy import lab_copy
from support.kernels import Output, finished, said_by, stacks_of_tree, started

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# A warning in a cell's stderr or the kernel's: a package the notebooks need is missing (torch's
# "Failed to initialize NumPy"), or something is deprecated; either way the user sees noise.
WARNING = re.compile(r"warning|failed to initiali[sz]e", re.I)
# ipykernel's notice on the kernel's stderr (JupyterLab's terminal, never a cell) whenever a kernel
# manager gives it TCP ports without CurveZMQ keys, as every Jupyter frontend does today.
TRANSPORT_NOTICE = "WARNING | Kernel is running over TCP without encryption."


@pytest.fixture(scope="module")
def lab():
    """A fresh copy of this tree after ``make setup workspace`` (removed after the module)."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="mk-lab-"))
    try:
        copy = lab_copy(where / "tree")
        print(f"make setup workspace in a fresh copy: {copy.setup_seconds:.0f} s")
        yield copy
    finally:
        shutil.rmtree(where, ignore_errors=True)


def outputs(nb) -> str:
    """Every output of the executed notebook, one after another (as ``support.kernels.Output`` reads them)."""
    found = (Output.from_notebook(node) for cell in nb.cells for node in cell.get("outputs", []))
    return "\n".join(o.text for o in found if o is not None)


def stdout(nb) -> str:
    """The notebook's stdout, every cell's in order, as one text."""
    return "".join(node.get("text", "") for cell in nb.cells for node in cell.get("outputs", [])
                   if node.get("output_type") == "stream" and node.get("name") == "stdout")


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "training.ipynb", "ddp.ipynb", "fsdp.ipynb",
                                           "tensor_parallel.ipynb", "distributed_tensors.ipynb"}


def warnings_in(nb) -> list[str]:
    """The lines of the notebook's stderr outputs that look like a warning."""
    return [line for cell in nb.cells for node in cell.get("outputs", [])
            if node.get("output_type") == "stream" and node.get("name") == "stderr"
            for line in node.get("text", "").splitlines() if WARNING.search(line)]


# The training notebooks run with the hang watchdog on (``--then abort``): none may raise a false alarm.
WATCHED = ("ddp", "fsdp")


# 600 s: the first test also waits for the module's `make setup` (under a minute with pip's cache).
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, lab, executed_notebooks):
    path = lab.workspace / path.name  # the copy `make lab` serves
    nb = nbformat.read(path, as_version=4)
    watched = path.stem in WATCHED
    if watched:  # the hang watchdog on, --then abort: training raises no false alarm (issue 44, point 5)
        nb.cells.insert(0, nbformat.v4.new_code_cell("%mesh watchdog 5 --then abort"))
    resources = {"metadata": {"path": str(path.parent)}}
    specs = KernelSpecManager(kernel_dirs=lab.kernel_dirs)
    assert specs.get_kernel_spec("monarch").argv[0] == str(lab.venv / "bin" / "python")
    # The kernel is started by the harness, which starts it again if a port it was given
    # was taken before it bound it (see ``support.kernels.started``); its stderr is read below.
    log = tempfile.TemporaryFile(mode="w+b")
    km, kc = started(lambda: KernelManager(kernel_name="monarch", kernel_spec_manager=specs),
                     cwd=str(path.parent), env=lab.env(), stderr=log)
    kc.stop_channels()
    client = NotebookClient(nb, timeout=240, km=km, resources=resources)
    try:
        client.execute()
    except Exception:  # what the notebook and the kernel said so far, and, for a hang, where every process stands
        print(f"{path.name} failed; its outputs so far:\n{outputs(nb)[-20000:]}")
        log.seek(0)
        print(f"the kernel's stderr so far:\n{log.read().decode(errors='replace')[-20000:]}")
        if km.provisioner is not None and km.provisioner.process is not None:
            print(f"the stacks of its kernel, templates and ranks:\n{stacks_of_tree(km.provisioner.process.pid)}")
        raise
    finally:
        if client.kc is not None:  # nbclient leaves the client of a kernel it did not start
            client.kc.stop_channels()
        finished(km, kc)
        log.seek(0)
        said = log.read().decode(errors="replace")
        log.close()
    nbformat.write(nb, path)  # as Run All then Save in JupyterLab
    assert not warnings_in(nb), warnings_in(nb)
    noise = [line for line in said.splitlines() if WARNING.search(line) and TRANSPORT_NOTICE not in line]
    assert not noise, f"the kernel's stderr:\n{said}"
    text = outputs(nb)
    if watched:
        assert "raises HangError" in text, text
        assert "HangError" not in text.replace("raises HangError", "") and "%mesh watchdog:" not in text, text
    if path.stem == "quickstart":
        assert "[ranks 0-3] hello from the mesh" in text
        assert "read 4 MiB over shm: sum 549755289600" in text  # RDMABuffer, rank 0 -> rank 3
        assert "[rank 1] ZeroDivisionError: division by zero\nTraceback" in text
        assert "rank 3 died: exited with code 3" in text
        assert "dead (exited with code 3)" in text
        assert "restarted [rank 3] with fresh namespaces" in text and "[rank 3] 3" in text
    if path.stem == "training":
        losses = [float(m) for m in re.findall(r"\[ranks 0-3\] epoch \d: loss ([0-9.]+)", text)]
        assert len(losses) == 8 and losses[-1] < losses[0] / 5
        assert "[ranks 0-3] (2.54, 1.74)" in text
    if path.stem == "ddp":
        check_ddp(text)
    if path.stem == "distributed_tensors":
        assert "monarch_kernel.Tensor(mesh='procs' {hosts=2, gpus=2}, shape=[3, 3], dtype=torch.float32" in text
        assert "rank (hosts=1, gpus=0): torch.Size([3, 3])" in text
        assert "poisoned: IndexError: index 7 is out of bounds for dimension 0 with size 3" in text
        assert "later ops still run: True" in text
        first, last = map(float, re.search(r"loss on rank 3: ([0-9.]+) -> ([0-9.]+)", text).groups())
        assert last < first / 2
        assert re.search(r"procs: \d+ tensors, [0-9,]+ bytes per rank", text)
        # Read from stdout alone: ipykernel may flush a print's first words before the rest (a
        # loaded machine can pause the cell between them), and a rank's stderr line arriving
        # meanwhile is an output of its own between the two halves.
        reduced = [line for line in stdout(nb).splitlines() if line.startswith(("sum over", "stacked over"))]
        assert reduced == ["sum over gpus, per host: [1.0, 5.0]", "sum over hosts, per gpu: [2.0, 4.0]",
                           "sum over both: 6.0", "stacked over gpus on hosts=1: [2.0, 3.0]"], \
            (reduced, [c.get("outputs") for c in nb.cells if "reduce(" in c.source])
        assert "the pipeline's output matches a local run: True" in text
        first, last = map(float, re.search(r"DDP loss on rank 0: ([0-9.]+) -> ([0-9.]+)", text).groups())
        assert last < first / 1.5
        assert "every replica holds the same weights after every step: True" in text
    if path.stem == "fsdp":
        for r in range(4):
            assert re.search(rf"rank {r}: parameters DDP 16\.\d MiB, FSDP2 4\.\d MiB \(25%\)", text), text
        assert float(re.search(r"largest loss difference DDP vs FSDP2: (\S+)", text).group(1)) < 1e-4
    if path.stem == "tensor_parallel":
        assert "DeviceMesh<{'dp': 2, 'tp': 2} cpu on 'procs'>" in text
        assert "{'dp': 1/2, 'tp': 1/2} dp, tp = (1, 1) fc1 weight shard (32, 32)" in text
        assert float(re.search(r"largest difference from the single-process run: (\S+)", text).group(1)) < 1e-4
    # Passed: the docs build takes its outputs (docs/_ext/mk_executed.py), less the watchdog's cell,
    # which is the test's and not the notebook's.
    if watched:
        del nb.cells[0]
    nbformat.write(nb, executed_notebooks / path.name)


def check_ddp(text: str) -> None:
    """The DDP notebook: a live plot; a rank SIGKILLed mid-training, replaced by the restart
    policy and the loop going on by itself (``elastic_run``), its state pulled from a
    survivor's memory, steps continuous from the last one every rank completed; then, with
    restarts off, a rank killed and the job going on at three ranks, and the rank brought back
    joining at four (shrink and grow, issue 44 point 4)."""
    assert "DDP training loss, per rank at step 500" in text  # the live plot's last update
    assert "process group aborted: rank 2 (killed by signal 9 (SIGKILL)) died" in text
    assert re.search(r"elastic_run on 'procs': rank 2 replaced \(rank 2 killed by signal 9 \(SIGKILL\)\); "
                     r"4 ranks from here", text), text
    resumed = re.search(r"\[rank 2\] resumed after step (\d+) from rank (\d)'s memory \(4 ranks\)", text)
    assert resumed and int(resumed.group(2)) != 2, text
    start = int(resumed.group(1))  # the last step every rank completed (the kill waits for the plot's step 150)
    survivors = said_by(text, f"resumed after step {start} from this rank's memory (4 ranks)")
    assert 100 <= start <= 250 and {0, 1, 3} <= set(survivors), (survivors, text)
    # Each step's report, whoever printed it, however collapsing grouped them (a rank slow to print
    # its copy on a loaded machine stands alone): one mean loss per step, from every rank.
    reports = step_reports(text)
    # The kill can land in the step report's all-reduce after some survivors left it (they print
    # the report and keep that step) and before the others did (they keep only the step before).
    # The job then resumes from that step before, every rank repeats the reported step, and its
    # report is printed again by all four ranks: the mean over the one step since the resume.
    cut_short = reports.get(start + 1, {})
    if len(cut_short) == 2:
        (_first, early), (again, everyone) = cut_short.items()  # in the order printed
        assert set(early) < {0, 1, 3} and sorted(everyone) == [0, 1, 2, 3], (cut_short, text)
        reports[start + 1] = {again: everyone}
    assert all(len(values) == 1 for values in reports.values()), (reports, text)
    ranks = {step: sorted(r for rs in values.values() for r in rs) for step, values in reports.items()}
    losses = {step: next(iter(values)) for step, values in reports.items() if step <= 250}
    # The report of the step the kill landed in: gloo's all-reduce can end on the survivors while
    # rank 2, killed inside it, never returns; they print it, and resume after it.
    assert all(ranks[step] == [0, 1, 2, 3] or (step == start and ranks[step] == [0, 1, 3]) for step in losses), \
        (ranks, text)
    assert sorted(losses) == [50, 100, 150, 200, 250], (losses, text)  # continuous, from where it stopped
    assert losses[250] < losses[100] < losses[50], losses
    assert "held-out accuracy after recovery:" in text
    # Shrink, then grow: the same survivors at three ranks, then rank 3 back from their memory.
    assert "[('shrunk', (3,), 3), ('grown', (3,), 4)]" in text, text
    assert re.search(r"elastic_run on 'procs': went on without rank 3 \(rank 3 killed by signal 9 \(SIGKILL\)\); "
                     r"3 ranks from here", text), text
    assert "elastic_run on 'procs': rank 3 joined; 4 ranks from here" in text, text
    shrunk = re.search(r"resumed after step (\d+) from this rank's memory \(3 ranks\)", text)
    grown = re.search(r"\[rank 3\] resumed after step (\d+) from rank [0-2]'s memory \(4 ranks\)", text)
    assert shrunk and grown and 250 < int(shrunk.group(1)) < int(grown.group(1)) < 500, text
    assert said_by(text, f"resumed after step {shrunk.group(1)} from this rank's memory (3 ranks)") == [0, 1, 2], text
    assert ranks.get(500) == [0, 1, 2, 3], (ranks, text)  # and at four to the end


def step_reports(text: str) -> dict[int, dict[float, list[int]]]:
    """``step N: loss X`` lines: step -> loss -> the ranks that printed it, from ``[rank r]`` and
    ``[ranks a-b,c]`` lines alike."""
    from monarch_kernel.runtime import parse_ranks

    out: dict[int, dict[float, list[int]]] = {}
    for label, step, loss in re.findall(r"^\[ranks? ([\d,-]+)\] step (\d+): loss ([0-9.]+)$", text, re.M):
        out.setdefault(int(step), {}).setdefault(float(loss), []).extend(parse_ranks(label, 1 << 16))
    return out


def served(runtime: pathlib.Path, server: subprocess.Popen, timeout: float = 90) -> dict:
    """The Jupyter server's own record (url, token, root_dir) once it is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in runtime.glob("jpserver-*.json"):
            info = json.loads(record.read_text() or "{}")
            if info.get("url"):
                return info
        assert server.poll() is None, f"make lab exited {server.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for make lab's server to write its record")


def api(info: dict, path: str, method: str = "GET", body: dict | None = None) -> dict:
    request = urllib.request.Request(f"{info['url'].rstrip('/')}/api/contents/{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {info['token']}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read() or b"{}")


@pytest.mark.timeout(600)
def test_make_lab_serves_copies_and_a_session_changes_no_tracked_file(lab):
    runtime = pathlib.Path(tempfile.mkdtemp(prefix="mk-lab-runtime-"))
    server = subprocess.Popen(["make", "lab"], cwd=lab.root, env=dict(lab.env(), JUPYTER_RUNTIME_DIR=str(runtime)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        info = served(runtime, server)
        assert os.path.realpath(info["root_dir"]) == os.path.realpath(lab.workspace)
        names = {item["name"] for item in api(info, "?content=1")["content"]}
        assert {p.name for p in NOTEBOOKS} <= names, names
        # Saving an edited notebook, as JupyterLab does: the file, then a checkpoint of it.
        saved = api(info, "quickstart.ipynb")
        saved["content"]["cells"][0]["source"] = "# my notes"
        api(info, "quickstart.ipynb", "PUT", {"type": "notebook", "format": "json", "content": saved["content"]})
        api(info, "quickstart.ipynb/checkpoints", "POST")
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # make and JupyterLab, which shuts its kernels down
        try:
            said = server.communicate(timeout=60)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            said = server.communicate()[0].decode(errors="replace")
        shutil.rmtree(runtime, ignore_errors=True)
    assert "Serving notebooks from local directory: " + str(lab.workspace) in said, said[-3000:]
    assert (lab.workspace / ".ipynb_checkpoints" / "quickstart-checkpoint.ipynb").exists()
    # `make lab` again keeps the edited copy, and puts back a deleted one.
    (lab.workspace / "training.ipynb").unlink()
    lab.make("workspace")
    assert nbformat.read(lab.workspace / "quickstart.ipynb", as_version=4).cells[0].source == "# my notes"
    assert (lab.workspace / "training.ipynb").read_bytes() == (lab.root / "notebooks" / "training.ipynb").read_bytes()
    # Whatever this session and the notebooks' runs before it left is ignored by git, and no
    # tracked file changed (notebooks/ included).
    assert lab.git_status() == [], lab.git_status()
    recorded = (lab.tools / "apt-get.log").read_text() if (lab.tools / "apt-get.log").exists() else ""
    assert all("--no-upgrade" in call for call in recorded.splitlines() if " install " in f" {call} "), recorded
