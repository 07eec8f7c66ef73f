"""JupyterLab in Debian's headless Chromium, driven with Playwright, for the tests of what a
user sees there (test_jupyterlab.py, the Mesh panel's test_panel_lab.py and test_panel_notes.py)
and of the server extension (test_server_api.py): ``Lab``, a real server whose state is all
under one folder; ``Notebook``, the open notebook in a page, every wait explicit; the panel's
selectors, screenshots and REST calls; and function-scoped ``lab`` and ``page`` fixtures."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                                    reason=f"{CHROMIUM} is missing: this test needs Debian's chromium "
                                           "(make installs it as root: apt-get install chromium)")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
DEBUG_BUTTON = ".jp-NotebookPanel-toolbar [data-jp-item-name='debugger-icon'] jp-button"
# This checkout's Mesh panel, as `make setup` builds it; JupyterLab takes it before any other
# copy (another checkout's, linked into the environment), so a test sees the code beside it.
PREBUILT = Path(__file__).resolve().parents[2] / "labextension" / "prebuilt"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "panel"
MESH = ".mk-Panel .mk-Mesh[data-mesh='{}']"
RANK = MESH + " .mk-Rank[data-rank='{}']"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server in its own process group, with config, settings, workspaces
    and runtime files under ``home`` so nothing of the user's is read or written."""

    def __init__(self, root: Path, home: Path):
        self.root, self.home = root, home
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = home / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> None:
        settings = self.home / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        # No "get notified about Jupyter news?" toast over the notebook (and no fetch).
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(self.home / "config"),
                   JUPYTERLAB_SETTINGS_DIR=str(self.home / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.home / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(self.home / "runtime"))
        cmd = [str(Path(sys.executable).with_name("jupyter")), "lab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", f"--ServerApp.token={self.token}", f"--notebook-dir={self.root}"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        if (PREBUILT / "package.json").is_file():
            own = self.home / "labextensions"
            own.mkdir()
            (own / "monarch-kernel-panel").symlink_to(PREBUILT, target_is_directory=True)
            cmd.append(f"--LabApp.extra_labextensions_path={own}")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._answers():
            assert self.proc.poll() is None, f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}"
            assert time.monotonic() < deadline, (f"timed out after {timeout} s waiting for JupyterLab to answer "
                                                 f"on {self.base}:\n{self.log_tail()}")
            time.sleep(0.2)

    def _request(self, path: str, method: str = "GET", timeout: float = 2):
        req = urllib.request.Request(self.base + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        return urllib.request.urlopen(req, timeout=timeout)

    def _answers(self) -> bool:
        try:
            with self._request("/api/status") as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def url(self, path: str) -> str:
        return f"{self.base}/lab/tree/{path}?token={self.token}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Shut the server down (it shuts its kernels down); whatever is left is killed:
        the process group, and the kernels, which run in process groups of their own."""
        if self.proc is None:
            return
        try:
            started = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            started = []
        with contextlib.suppress(OSError, urllib.error.URLError):
            self._request("/api/shutdown", method="POST", timeout=5).close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        _, alive = psutil.wait_procs(started, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)


class Notebook:
    """The open notebook in the page; every wait is explicit, and a failed step leaves a
    screenshot whose path the assertion names."""

    def __init__(self, page, shots: Path, lab: Lab):
        self.page, self.shots, self.lab, self.expect = page, shots, lab, sync_api.expect
        self.cells = page.locator(".jp-Notebook .jp-CodeCell")

    @contextlib.contextmanager
    def step(self, what: str):
        try:
            yield
        except (AssertionError, sync_api.Error) as e:
            shot = self.shots / (re.sub(r"\W+", "-", what).strip("-") + ".png")
            with contextlib.suppress(sync_api.Error):
                self.page.screenshot(path=str(shot))
            raise AssertionError(f"{what}: {e}\nscreenshot: {shot}\nserver log:\n{self.lab.log_tail(15)}") from e

    def click_breakpoint_gutter(self, cell, line: int) -> None:
        """Click the debugger's gutter (left of the line numbers) beside line ``line``,
        where a user clicks; the line number itself does not toggle a breakpoint."""
        number = cell.locator(".cm-lineNumbers .cm-gutterElement", has_text=re.compile(rf"^{line}$"))
        gutter = cell.locator(".cm-gutter.cm-breakpoint-gutter")
        row, column = number.bounding_box(timeout=15_000), gutter.bounding_box(timeout=15_000)
        self.page.mouse.click(column["x"] + column["width"] / 2, row["y"] + row["height"] / 2)

    def output(self, i: int) -> str:
        """Cell ``i``'s output as a person reads it: a line's trailing blanks (left where the
        cell's progress line was blanked out with ``\\r`` and spaces) are not text."""
        text = self.cells.nth(i).locator(".jp-OutputArea").inner_text()
        return "\n".join(line.rstrip(" ") for line in text.split("\n"))

    def start_cell(self, i: int) -> None:
        self.cells.nth(i).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Shift+Enter")

    def wait_cell(self, i: int, timeout: float = 60) -> str:
        """Wait for cell ``i``'s prompt to show an execution count; return its output."""
        self.expect(self.cells.nth(i).locator(".jp-InputPrompt")).to_have_text(
            re.compile(r"\[\d+\]"), timeout=timeout * 1000)
        return self.output(i)

    def run_cell(self, i: int, timeout: float = 60) -> str:
        self.start_cell(i)
        return self.wait_cell(i, timeout)


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "monarch", "display_name": "Python 3 (monarch mesh)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, str(path))


def rest(lab: Lab, path: str, method: str = "GET", body: bytes | None = None, token: bool = True):
    """(status, JSON body) of a request to the server."""
    headers = {"Authorization": f"token {lab.token}"} if token else {}
    req = urllib.request.Request(lab.base + path, method=method, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=90) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw or b"{}")
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")[:200]}


@pytest.fixture
def lab(tmp_path, kernelspec):
    root, home = tmp_path / "notebooks", tmp_path / "jupyter"
    root.mkdir()
    home.mkdir()
    server = Lab(root, home)
    try:
        server.start()
        yield server
    finally:
        try:  # a detached mesh the test left (it failed midway) must not outlive it
            for m in rest(server, "/monarch/meshes")[1].get("meshes", []):
                rest(server, f"/monarch/meshes/{m['name']}", "DELETE")
        except OSError:
            pass
        server.stop()


@pytest.fixture
def page():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 1000})
        finally:
            browser.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


class Loading:
    """What went wrong while a page loaded, recorded from before it is asked for: requests
    that failed (their URL and why), answers with an HTTP error (their URL and status), and
    the browser console's errors (a stylesheet refused for its MIME type says so there only)."""

    def __init__(self, page):
        self.page, self.failed = page, []
        page.on("requestfailed", self._failed)
        page.on("response", self._answered)
        page.on("console", self._said)

    def _failed(self, request) -> None:
        self.failed.append(f"{request.method} {request.url}: {request.failure}")

    def _answered(self, response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.request.method} {response.url}: HTTP {response.status}")

    def _said(self, message) -> None:
        if message.type == "error":
            self.failed.append(f"console: {message.text}")

    def stop(self) -> None:
        self.page.remove_listener("requestfailed", self._failed)
        self.page.remove_listener("response", self._answered)
        self.page.remove_listener("console", self._said)


def load_notebook(nb: Notebook, url: str, timeout: float = 120) -> None:
    """Load JupyterLab at ``url`` and wait, ``timeout`` s at most for each step, until its
    theme is applied (JupyterLab sets ``body[data-jp-theme-name]`` once the theme's CSS has
    loaded; until then its splash covers the page) and the notebook's kernel is idle.  On a
    crowded machine this takes far longer than Playwright's 30 s default, and is waited for;
    a dialog instead ("Error Loading Theme": the theme's CSS did not load) fails here with
    the requests that failed, their URL and status or error."""
    page, ms = nb.page, timeout * 1000
    for attempt in range(3):
        loading = Loading(page)
        try:
            page.goto(url, wait_until="commit", timeout=ms)
            page.wait_for_selector("body[data-jp-theme-name], .jp-Dialog", state="attached", timeout=ms)
            dialog = page.locator(".jp-Dialog")
            if not dialog.count():
                break
            # Chromium fails the requests in flight when an interface comes or goes on the
            # machine (ERR_NETWORK_CHANGED): another worker's test making its network
            # namespaces (fresh68).  Nothing of JupyterLab's: load the page again.
            if attempt < 2 and any("ERR_NETWORK_CHANGED" in f for f in loading.failed):
                continue
            raise AssertionError(f"JupyterLab showed a dialog while loading {url}: "
                                 f"{' '.join(dialog.first.inner_text().split())!r}; what failed: "
                                 f"{'; '.join(loading.failed) or 'no request, nothing in the console'}")
        finally:
            loading.stop()
    loading = Loading(page)
    try:
        page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=ms)
        page.wait_for_selector(".jp-Toolbar-kernelName[aria-label*='monarch mesh']", timeout=ms)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=ms)
    finally:
        loading.stop()


def open_notebook(nb: Notebook, lab: Lab, name: str, widen: bool = True) -> None:
    page = nb.page
    load_notebook(nb, lab.url(name) + "&reset")  # this notebook only (the workspace forgets earlier ones)
    tab = page.locator(".jp-SideBar.jp-mod-right li[data-id='monarch-kernel-meshes']")
    if tab.get_attribute("aria-selected") != "true":
        tab.click()
    page.wait_for_selector(".mk-Panel .mk-Panel-empty, .mk-Panel .mk-Mesh", timeout=30_000)
    if not widen:
        return
    # Widen the right sidebar, as a user does to see the whole rank grid.
    handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle:not(.lm-mod-hidden)").last
    box = handle.bounding_box(timeout=10_000)
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x - 420, y, steps=5)
    page.mouse.up()


def box_of(locator, timeout_s: float = 10.0) -> dict | None:
    """``locator``'s bounding box, measured again while it has none: the panel redraws its
    rows and sparklines as metrics come (every second), and an element measured just as it is
    replaced has no box.  None if it has had none for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        box = locator.bounding_box(timeout=timeout_s * 1000)
        if box is not None or time.monotonic() > deadline:
            return box
        locator.page.wait_for_timeout(50)


def inside(box: dict | None, outer: dict) -> bool:
    return box is not None and box["width"] > 0 and box["height"] > 0 and (
        outer["x"] <= box["x"] and box["x"] + box["width"] <= outer["x"] + outer["width"]
        and outer["y"] <= box["y"] and box["y"] + box["height"] <= outer["y"] + outer["height"])
