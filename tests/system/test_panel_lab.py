"""The Mesh panel in a real JupyterLab and Debian's Chromium (Playwright), on the monarch
kernel: it shows 4 ranks, a rank that exits as dead within 2 s and restarts it, interrupts
one rank of a running cell, points the debugger at a rank that then stops at a gutter
breakpoint, lays figures out as a grid, spawns a detached mesh from its dialog, and after
the kernel shuts down lists, attaches and stops that mesh through the server extension's
REST API; a mesh of 40 ranks shows counts by state and its dead rank, and every rank on
demand.  At JupyterLab's default sidebar width a 4-rank mesh fits (state, history, last line
and actions inside the panel), the kernel status reads Busy while a cell runs with the panel
open, and a mesh's message goes with the mesh.  Screenshots go to test-artifacts/panel/
(gitignored)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest
from support import browser
from support.browser import (
    DEBUG_BUTTON,
    MESH,
    RANK,
    Notebook,
    box_of,
    inside,
    needs_chromium,
    open_notebook,
    rest,
    shot,
    sync_api,
    write_notebook,
)

pytestmark = [needs_chromium, pytest.mark.timeout(300)]
lab, page = browser.lab, browser.page  # the fixtures: a JupyterLab, a Chromium page

CELLS = [
    "procs = %mesh spawn -n 4",                                                     # 0
    "%%mesh --ranks 2\nimport os\nos._exit(3)",                                     # 1
    "%%mesh\nprint('alive')",                                                       # 2
    "%%mesh\nimport time\ntime.sleep(12)\nprint('slept')",                          # 3
    "%%mesh --ranks 1\nfrom monarch_kernel import current_rank\nx = 41 + current_rank().rank\ny = x * 2\n"
    "print('y', y)",                                                                # 4
    "%%mesh --ranks 0-1\nimport matplotlib.pyplot as plt\nfrom monarch_kernel import current_rank\n"
    "plt.plot([0, 1], [0, current_rank().rank + 1])\nplt.show()",                   # 5
    "%%mesh\nfrom monarch_kernel import current_rank\nmarker = current_rank().rank * 7",  # 6 (on the dialog's mesh)
    "big = %mesh spawn -n 40 --name big",                                           # 7 (summarised: > 32 ranks)
    "%%mesh --ranks 7\nimport os\nos._exit(3)",                                     # 8 (on big)
]
BREAKPOINT_LINE = 4  # ``y = x * 2`` in CELLS[4], the magic line counted as 1


def test_the_mesh_panel_shows_and_steers_ranks_in_a_browser(lab, page, tmp_path):
    write_notebook(lab.root / "panel.ipynb", CELLS)
    write_notebook(lab.root / "again.ipynb", ["%%mesh\nprint('marker', marker)"])
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect

    with nb.step("open the notebook: the panel is in the right sidebar"):
        open_notebook(nb, lab, "panel.ipynb")

    with nb.step("spawn 4 ranks: the panel shows 4 ranks"):
        nb.run_cell(0)
        expect(page.locator(MESH.format("procs") + " .mk-Rank")).to_have_count(4, timeout=10_000)
        expect(page.locator(".mk-Status")).to_have_text("procs: 4 ranks", timeout=10_000)
        # The sparklines: the panel samples each rank once a second while it shows.
        spark = page.locator(RANK.format("procs", 0) + " .mk-Rank-spark .mk-Spark-rss")
        expect(spark).to_have_count(1, timeout=15_000)
        page.wait_for_function("sel => (document.querySelector(sel)?.getAttribute('points') || '').split(' ')"
                               ".length >= 2", arg=RANK.format("procs", 0) + " .mk-Rank-spark .mk-Spark-rss",
                               timeout=15_000)
        shot(page, "1-four-ranks")

    with nb.step("os._exit on rank 2: dead within 2 s; restart: alive, and every rank answers"):
        nb.run_cell(1)
        t0 = time.monotonic()
        expect(page.locator(RANK.format("procs", 2))).to_have_attribute("data-state", "dead", timeout=2_000)
        assert time.monotonic() - t0 < 2.5
        expect(page.locator(".mk-Status")).to_have_text("procs: 4 ranks · 1 dead", timeout=5_000)
        shot(page, "2-rank-2-dead")
        page.locator(RANK.format("procs", 2) + " [data-action='restart']").click()
        expect(page.locator(RANK.format("procs", 2))).to_have_attribute("data-state", "idle", timeout=30_000)
        assert "[ranks 0-3] alive" in nb.run_cell(2).splitlines()

    with nb.step("a long cell, then rank 1's interrupt button: KeyboardInterrupt on rank 1 only"):
        nb.start_cell(3)
        expect(page.locator(RANK.format("procs", 1))).to_have_attribute("data-state", "busy", timeout=10_000)
        page.locator(MESH.format("procs") + " [data-action='stacks']").click()  # while the cell runs
        stacks = page.locator(".mk-Stacks-text").first
        expect(stacks).to_contain_text("Stacks of mesh 'procs': 4 ranks", timeout=30_000)
        # the cell, on every rank, named as tracebacks name it
        expect(stacks).to_contain_text(re.compile(r"\[ranks 0-3\] cell \[\d+\], line 3: time\.sleep\(12\)"))
        shot(page, "stacks-while-a-cell-runs")
        # Close the tab: the notebook is the active widget again (the debugger follows it).
        page.locator(".lm-TabBar-tab:has-text('Stacks: procs') .lm-TabBar-tabCloseIcon").click()
        expect(page.locator(".mk-Stacks")).to_have_count(0, timeout=5_000)
        page.locator(RANK.format("procs", 1) + " [data-action='interrupt']").click()
        out = nb.wait_cell(3, timeout=30)
        assert "[ranks 0,2-3] slept" in out.splitlines() and "KeyboardInterrupt" in out, out
        assert "[rank 1]" in out and "[rank 0] Traceback" not in out, out

    with nb.step("debug this rank (1), then a gutter breakpoint: rank 1 stops, and the panel says so"):
        page.locator(RANK.format("procs", 1) + " [data-action='debug']").click()
        expect(page.locator(MESH.format("procs") + " .mk-Mesh-message")).to_contain_text(
            "debugger now debugs rank 1", timeout=30_000)
        page.locator(DEBUG_BUTTON).click()
        page.wait_for_selector(DEBUG_BUTTON + "[aria-pressed='true']", timeout=30_000)
        cell = nb.cells.nth(4)
        nb.click_breakpoint_gutter(cell, BREAKPOINT_LINE)
        expect(page.locator(".jp-DebuggerBreakpoints-body .jp-DebuggerBreakpoint")).to_have_count(1, timeout=15_000)
        nb.start_cell(4)
        page.wait_for_selector(".jp-DebuggerPausedOverlay", timeout=30_000)
        expect(page.locator(RANK.format("procs", 1))).to_have_attribute("data-state", "debugger", timeout=5_000)
        expect(page.locator(".mk-Status")).to_contain_text("rank 1 in debugger", timeout=5_000)
        shot(page, "3-rank-1-in-debugger")
        page.locator(".jp-DebuggerSidebar jp-button[data-command='debugger:continue']").click()
        assert "[rank 1] y 84" in nb.wait_cell(4).splitlines()
        page.locator(DEBUG_BUTTON).click()  # debugger off again
        tab = page.locator(".jp-SideBar.jp-mod-right li[data-id='monarch-kernel-meshes']")
        if tab.get_attribute("aria-selected") != "true":
            tab.click()

    with nb.step("figures from two ranks lay out side by side"):
        nb.run_cell(5)
        grid = nb.cells.nth(5).locator(".mk-RankGridOutput .mk-RankGridOutput-cell")
        expect(grid).to_have_count(2, timeout=15_000)
        expect(grid.locator("img")).to_have_count(2, timeout=15_000)
        a, b = grid.nth(0).bounding_box(), grid.nth(1).bounding_box()
        assert abs(a["y"] - b["y"]) < 2 and b["x"] > a["x"], (a, b)
        shot(page, "4-figures-grid")

    with nb.step("the log tab: rank 2's lines, searchable"):
        page.locator(RANK.format("procs", 2) + " [data-action='show-log']").click()
        log = page.locator(".mk-Log").first
        expect(log.locator(".mk-Log-line[data-rank='2']").first).to_be_visible(timeout=10_000)
        expect(log.locator(".mk-Log-line[data-rank='0']")).to_have_count(0)
        log.locator(".mk-Log-rank").select_option("")
        log.locator(".mk-Log-search").fill("slept")
        expect(log.locator(".mk-Log-line")).to_have_count(3, timeout=5_000)
        shot(page, "5-log")

    with nb.step("New mesh: a detached mesh of 2 ranks from the dialog"):
        page.locator(".mk-Panel [data-action='new-mesh']").click()
        dialog = page.locator(".jp-Dialog .mk-NewMesh")
        dialog.locator("input[name='n']").fill("2")
        dialog.locator("input[name='name']").fill("side")
        dialog.locator("input[name='detach']").check()
        page.locator(".jp-Dialog .jp-mod-accept").click()
        expect(page.locator(MESH.format("side") + " .mk-Rank")).to_have_count(2, timeout=60_000)
        expect(page.locator(MESH.format("side"))).to_have_attribute("data-kind", "detached")
        # The dialog's mesh is not current until the user says so (Use): cell 6 runs on it.
        expect(page.locator(MESH.format("procs") + " .mk-Mesh-current")).to_have_count(1)
        page.locator(MESH.format("side") + " [data-action='use']").click()
        expect(page.locator(MESH.format("side") + " .mk-Mesh-current")).to_have_count(1, timeout=10_000)
        nb.run_cell(6)
        shot(page, "6-two-meshes")
        page.locator(MESH.format("procs") + " [data-action='stop']").click()
        expect(page.locator(MESH.format("procs"))).to_have_count(0, timeout=30_000)

    with nb.step("40 ranks: counts by state in the header, only the dead rank listed, Show all ranks lists all"):
        big = page.locator(MESH.format("big"))
        nb.run_cell(7, timeout=90)
        expect(big.locator(".mk-Mesh-info")).to_contain_text("40 ranks · idle 40 ·", timeout=15_000)
        expect(big).to_have_attribute("data-summary", "true")
        expect(big.locator(".mk-Rank")).to_have_count(0)
        expect(big.locator(".mk-Mesh-note")).to_contain_text("every rank is idle")
        nb.run_cell(8)
        expect(big.locator(".mk-Mesh-info")).to_contain_text("40 ranks · idle 39 · dead 1 ·", timeout=5_000)
        expect(big.locator(".mk-Rank")).to_have_count(1)
        expect(page.locator(RANK.format("big", 7))).to_have_attribute("data-state", "dead")
        expect(page.locator(".mk-Status")).to_have_text(re.compile(r"^big: 40 ranks · 1 dead"), timeout=5_000)
        shot(page, "8-forty-ranks-summarised")
        big.locator("[data-action='toggle-table']").click()
        expect(big.locator(".mk-Rank")).to_have_count(40, timeout=10_000)
        expect(big).to_have_attribute("data-expanded", "true")
        expect(big.locator("[data-action='toggle-table']")).to_have_text("Summarise")
        shot(page, "9-forty-ranks-all")
        big.locator("[data-action='toggle-table']").click()
        expect(big.locator(".mk-Rank")).to_have_count(1, timeout=10_000)
        big.locator("[data-action='stop']").click()
        expect(big).to_have_count(0, timeout=30_000)

    with nb.step("shut the kernel down: GET /monarch/meshes still lists the detached mesh"):
        kernels = rest(lab, "/api/kernels")[1]
        assert len(kernels) == 1, kernels
        assert rest(lab, f"/api/kernels/{kernels[0]['id']}", "DELETE")[0] == 204
        status, body = rest(lab, "/monarch/meshes")
        assert status == 200, body
        (side,) = body["meshes"]
        assert side["name"] == "side" and side["ranks"] == 2 and side["state"] == "running", side
        assert len(side["pids"]) == 2 and all(side["pids"]) and side["kernel"] is None, side
        pids = [*side["pids"], side["host_pid"]]

    with nb.step("the REST API: no token, unknown names, malformed bodies"):
        status, body = rest(lab, "/monarch/meshes", token=False)
        assert status == 403, (status, body)
        status, body = rest(lab, "/monarch/meshes/nope", "DELETE")
        assert status == 404 and body["message"] == "no detached mesh named 'nope'", body
        status, body = rest(lab, "/monarch/meshes/side/attach", "POST", b"{not json")
        assert status == 400 and "kernel_id" in body["message"], body
        status, body = rest(lab, "/monarch/meshes/side/attach", "POST", b'{"kernel_id": 3}')
        assert status == 400, body
        status, body = rest(lab, "/monarch/meshes/side/attach", "POST", b'{"kernel_id": "no-such-kernel"}')
        assert status == 400 and "is not a kernel id" in body["message"], body  # not a UUID: refused unread
        status, body = rest(lab, "/monarch/meshes/side/attach", "POST",
                            b'{"kernel_id": "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f"}')
        assert status == 404 and "no kernel" in body["message"], body

    with nb.step("a new notebook's panel shows it under Detached; Attach keeps the ranks' state"):
        open_notebook(nb, lab, "again.ipynb")
        row = page.locator(".mk-Panel .mk-Detached[data-mesh='side']")
        expect(row).to_have_count(1, timeout=30_000)
        shot(page, "7-detached")
        row.locator("[data-action='attach']").click()
        expect(page.locator(MESH.format("side") + " .mk-Rank")).to_have_count(2, timeout=60_000)
        out = nb.run_cell(0).splitlines()
        assert "[rank 0] marker 0" in out and "[rank 1] marker 7" in out, out
        kernel = rest(lab, "/monarch/meshes")[1]["meshes"][0]["kernel"]
        assert kernel == rest(lab, "/api/kernels")[1][0]["id"]

    with nb.step("stop it from the panel: no process remains"):
        page.locator(MESH.format("side") + " [data-action='stop']").click()
        expect(page.locator(MESH.format("side"))).to_have_count(0, timeout=60_000)
        deadline = time.monotonic() + 15
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, f"processes of the detached mesh remain: {pids}"
            time.sleep(0.1)
        assert rest(lab, "/monarch/meshes")[1]["meshes"] == []


NARROW = [
    "procs = %mesh spawn -n 4",                                                     # 0
    "%%mesh\nprint('a last line longer than the sidebar is wide, cut at its edge')",  # 1
    "%%mesh\nimport time\ntime.sleep(8)",                                           # 2
    "%mesh stop",                                                                   # 3
]
KERNEL_STATUS = ".jp-StatusBar-TextItem[title^='Change kernel']"  # "Python 3 (monarch mesh) | Busy"


def test_the_panel_at_the_default_width_fits_and_leaves_the_busy_state_alone(lab, page, tmp_path):
    write_notebook(lab.root / "narrow.ipynb", NARROW)
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect

    with nb.step("open the notebook; the panel keeps JupyterLab's default sidebar width"):
        open_notebook(nb, lab, "narrow.ipynb", widen=False)

    with nb.step("4 ranks: each rank's state, history, last line and actions lie inside the panel"):
        nb.run_cell(0)
        nb.run_cell(1)
        expect(page.locator(MESH.format("procs") + " .mk-Rank")).to_have_count(4, timeout=10_000)
        for r in range(4):
            page.wait_for_function("sel => (document.querySelector(sel)?.getAttribute('points') || '')"
                                   ".split(' ').length >= 2", arg=RANK.format("procs", r) + " .mk-Spark-rss",
                                   timeout=15_000)
        expect(page.locator(RANK.format("procs", 3) + " .mk-Rank-last")).to_contain_text("a last line", timeout=5_000)
        panel = page.locator(".mk-Panel").bounding_box()
        assert panel is not None and panel["width"] < 400, f"not JupyterLab's default sidebar width: {panel}"
        shot(page, "narrow-four-ranks")
        for r in range(4):
            row = page.locator(RANK.format("procs", r))
            for part in (".mk-Rank-state", ".mk-Rank-spark .mk-Spark", ".mk-Rank-last", "[data-action='interrupt']",
                         "[data-action='debug']", "[data-action='rank-stacks']", "[data-action='show-log']"):
                box = box_of(row.locator(part))
                assert inside(box, panel), f"rank {r}'s {part} at {box}, outside the panel at {panel}"
        widths = page.evaluate("() => { const p = document.querySelector('.mk-Panel');"
                               " return [p.scrollWidth, p.clientWidth]; }")
        assert widths[0] <= widths[1], f"the panel scrolls sideways: {widths}"

    with nb.step("an 8 s cell with the panel open (and polling): the kernel status reads Busy throughout"):
        nb.start_cell(2)
        expect(page.locator(RANK.format("procs", 0))).to_have_attribute("data-state", "busy", timeout=10_000)
        samples, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 5:  # the panel asks for its history every second meanwhile
            samples.append(page.locator(KERNEL_STATUS).inner_text())
            page.wait_for_timeout(250)
        assert samples and all(s.endswith("| Busy") for s in samples), samples
        nb.wait_cell(2, timeout=30)
        expect(page.locator(KERNEL_STATUS)).to_have_text(re.compile(r"\| Idle$"), timeout=10_000)

    with nb.step("Stacks: its message shows in the mesh's box; %mesh stop: it goes with the mesh"):
        page.locator(MESH.format("procs") + " [data-action='stacks']").click()
        expect(page.locator(MESH.format("procs") + " .mk-Mesh-message")).to_contain_text("stacks of procs",
                                                                                        timeout=30_000)
        page.locator(".lm-TabBar-tab:has-text('Stacks: procs') .lm-TabBar-tabCloseIcon").click()
        shot(page, "narrow-stacks-message")
        nb.run_cell(3)
        expect(page.locator(MESH.format("procs"))).to_have_count(0, timeout=15_000)
        expect(page.locator(".mk-Panel")).not_to_contain_text("stacks of procs")


def test_readme_picture_is_committed():
    """The README shows the panel (a screenshot this test module's browser test takes)."""
    picture = Path(__file__).resolve().parents[2] / "docs" / "mesh-panel.png"
    assert picture.is_file() and picture.stat().st_size > 10_000
    assert re.search(r"!\[[^\]]*\]\(docs/mesh-panel\.png\)", (picture.parent.parent / "README.md").read_text())
