"""What the Mesh panel says, in a real JupyterLab and Debian's Chromium (Playwright): at
JupyterLab's default sidebar width a dead rank's state and last line show whole (a compact
state, how it died and its last line wrapped); a note about what a button did goes when it
stops being true (the next cell, the end of the cell whose stacks it told); the Detached list
never calls a mesh "attached to this notebook"; a per-rank Interrupt is said in the running
cell when it happens; and New mesh is told to the notebook without taking its current mesh.
Screenshots go to test-artifacts/panel/ (gitignored)."""

from __future__ import annotations

import re
import time

import pytest
from support import browser
from support.browser import (
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
MESSAGE = MESH + " .mk-Mesh-message"

NOTES = [
    "procs = %mesh spawn -n 4",                                                     # 0
    "%%mesh --ranks 2\nimport os, signal, time\n"
    "print('the last words of rank two, longer than the panel is wide', flush=True)\ntime.sleep(0.5)\n"
    "os.kill(os.getpid(), signal.SIGKILL)",                                         # 1
    "%%mesh\nimport time\ntime.sleep(6)",                                           # 2
    "%%mesh\nprint('next')",                                                        # 3
]


def fits(page, selector: str) -> bool:
    """Whether the element's text shows whole: nothing cut at its edges."""
    return page.evaluate("sel => { const e = document.querySelector(sel);"
                         " return !!e && e.scrollWidth <= e.clientWidth && e.scrollHeight <= e.clientHeight; }",
                         selector)


def test_a_dead_ranks_state_and_last_line_show_whole_at_the_default_width(lab, page, tmp_path):
    write_notebook(lab.root / "notes.ipynb", NOTES)
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect

    with nb.step("open the notebook at JupyterLab's default sidebar width; 4 ranks"):
        open_notebook(nb, lab, "notes.ipynb", widen=False)
        nb.run_cell(0)
        expect(page.locator(MESH.format("procs") + " .mk-Rank")).to_have_count(4, timeout=10_000)

    with nb.step("rank 2 killed by SIGKILL: 'dead · SIGKILL', how it died and its last line, all whole"):
        nb.run_cell(1)
        dead = RANK.format("procs", 2)
        expect(page.locator(dead)).to_have_attribute("data-state", "dead", timeout=10_000)
        state = page.locator(dead + " .mk-Rank-state")
        expect(state).to_have_text("dead · SIGKILL")
        expect(state).to_have_attribute("title", "dead: killed by signal 9 (SIGKILL)")
        last = page.locator(dead + " .mk-Rank-last")
        expect(last).to_contain_text("killed by signal 9 (SIGKILL)", timeout=5_000)
        expect(last).to_contain_text("the last words of rank two, longer than the panel is wide", timeout=5_000)
        panel = page.locator(".mk-Panel").bounding_box()
        assert panel is not None and panel["width"] < 400, f"not JupyterLab's default sidebar width: {panel}"
        shot(page, "narrow-dead-rank")
        for part in (".mk-Rank-state", ".mk-Rank-last", "[data-action='restart']"):
            box = box_of(page.locator(dead + " " + part))
            assert inside(box, panel), f"rank 2's {part} at {box}, outside the panel at {panel}"
            shown = page.locator(dead + " " + part).inner_text()
            assert fits(page, dead + " " + part), f"rank 2's {part} is cut: {shown!r}"

    with nb.step("a sidebar wide enough for one table row a rank: the same, whole"):
        handle = page.locator("#jp-main-split-panel > .lm-SplitPanel-handle:not(.lm-mod-hidden)").last
        box = handle.bounding_box(timeout=10_000)
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(x, y)
        page.mouse.down()
        page.mouse.move(x - 600, y, steps=5)
        page.mouse.up()
        page.wait_for_function("() => document.querySelector('.mk-Panel').clientWidth >= 760", timeout=10_000)
        expect(page.locator(MESH.format("procs") + " .mk-RankGrid thead")).to_be_visible()
        panel = page.locator(".mk-Panel").bounding_box()
        shot(page, "wide-dead-rank")
        for part in (".mk-Rank-state", ".mk-Rank-last"):
            box = box_of(page.locator(dead + " " + part))
            assert inside(box, panel), f"rank 2's {part} at {box}, outside the panel at {panel}"
            shown = page.locator(dead + " " + part).inner_text()
            assert fits(page, dead + " " + part), f"rank 2's {part} is cut: {shown!r}"


def test_a_note_about_a_button_goes_when_it_stops_being_true(lab, page, tmp_path):
    write_notebook(lab.root / "notes.ipynb", NOTES)
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect
    dead = RANK.format("procs", 2)

    with nb.step("4 ranks, and rank 2 dead"):
        open_notebook(nb, lab, "notes.ipynb")
        nb.run_cell(0)
        nb.run_cell(1)
        expect(page.locator(dead)).to_have_attribute("data-state", "dead", timeout=10_000)

    with nb.step("Restart rank 2: its note shows until the next cell begins"):
        page.locator(dead + " [data-action='restart']").click()
        expect(page.locator(dead)).to_have_attribute("data-state", "idle", timeout=30_000)
        expect(page.locator(MESSAGE.format("procs"))).to_contain_text("restarted rank 2 of procs", timeout=10_000)
        nb.start_cell(2)
        expect(page.locator(MESSAGE.format("procs"))).to_be_hidden(timeout=10_000)

    with nb.step("Stacks while the cell runs: its note goes when that cell ends"):
        expect(page.locator(RANK.format("procs", 1))).to_have_attribute("data-state", "busy", timeout=10_000)
        page.locator(MESH.format("procs") + " [data-action='stacks']").click()
        expect(page.locator(MESSAGE.format("procs"))).to_contain_text("stacks of procs", timeout=30_000)
        page.locator(".lm-TabBar-tab:has-text('Stacks: procs') .lm-TabBar-tabCloseIcon").click()
        assert page.locator(".jp-Notebook .jp-CodeCell").nth(2).locator(".jp-InputPrompt").inner_text().strip() \
            == "[*]:", "the cell ended before its stacks were told"
        shot(page, "narrow-stacks-note-mid-cell")
        nb.wait_cell(2, timeout=30)
        expect(page.locator(MESSAGE.format("procs"))).to_be_hidden(timeout=10_000)

    with nb.step("Stacks of idle ranks: the note goes when the next cell begins"):
        page.locator(MESH.format("procs") + " [data-action='stacks']").click()
        expect(page.locator(MESSAGE.format("procs"))).to_contain_text("stacks of procs", timeout=30_000)
        page.locator(".lm-TabBar-tab:has-text('Stacks: procs') .lm-TabBar-tabCloseIcon").click()
        assert "[ranks 0-3] next" in nb.run_cell(3).splitlines()
        expect(page.locator(MESSAGE.format("procs"))).to_be_hidden(timeout=10_000)
        expect(page.locator(".mk-Panel")).not_to_contain_text("stacks of procs")
        shot(page, "narrow-notes-gone")


TOLD = [
    "procs = %mesh spawn -n 3",                                                     # 0
    "%%mesh\nimport time\ntime.sleep(10)\nprint('slept')",                          # 1
    "%%mesh\nprint('where')",                                                       # 2
]


def test_an_interrupt_from_the_panel_is_said_in_the_running_cell_at_once(lab, page, tmp_path):
    write_notebook(lab.root / "told.ipynb", TOLD)
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect

    with nb.step("open the notebook; 3 ranks"):
        open_notebook(nb, lab, "told.ipynb")
        nb.run_cell(0)
        expect(page.locator(MESH.format("procs") + " .mk-Rank")).to_have_count(3, timeout=10_000)

    with nb.step("rank 1's Interrupt while the cell runs: the cell says so at once, not when it ends"):
        nb.start_cell(1)
        expect(page.locator(RANK.format("procs", 1))).to_have_attribute("data-state", "busy", timeout=10_000)
        page.locator(RANK.format("procs", 1) + " [data-action='interrupt']").click()
        cell = nb.cells.nth(1)
        expect(cell.locator(".jp-OutputArea")).to_contain_text("[rank 1] interrupted from the Mesh panel",
                                                                timeout=5_000)
        assert cell.locator(".jp-InputPrompt").inner_text().strip() == "[*]:", "said only when the cell ended"
        shot(page, "interrupt-said-in-the-cell")
        out = nb.wait_cell(1, timeout=30)
        assert "[ranks 0,2] slept" in out.splitlines() and out.count("interrupted from the Mesh panel") == 1, out


def test_new_mesh_is_told_to_the_notebook_and_leaves_its_current_mesh(lab, page, tmp_path):
    write_notebook(lab.root / "told.ipynb", TOLD)
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect

    with nb.step("open the notebook; 3 ranks"):
        open_notebook(nb, lab, "told.ipynb")
        nb.run_cell(0)
        expect(page.locator(MESH.format("procs") + " .mk-Rank")).to_have_count(3, timeout=10_000)

    with nb.step("New mesh from the dialog: procs stays current, the panel and the next cell say so"):
        page.locator(".mk-Panel [data-action='new-mesh']").click()
        dialog = page.locator(".jp-Dialog .mk-NewMesh")
        dialog.locator("input[name='n']").fill("2")
        dialog.locator("input[name='name']").fill("side")
        page.locator(".jp-Dialog .jp-mod-accept").click()
        expect(page.locator(MESH.format("side") + " .mk-Rank")).to_have_count(2, timeout=60_000)
        expect(page.locator(MESH.format("procs") + " .mk-Mesh-current")).to_have_count(1, timeout=10_000)
        expect(page.locator(MESH.format("side") + " .mk-Mesh-current")).to_have_count(0)
        top = page.locator(".mk-Panel-message")
        expect(top).to_contain_text("procs stays current", timeout=10_000)
        shot(page, "new-mesh-told")
        lines = nb.run_cell(2).splitlines()
        assert lines[0].startswith("%mesh: the Mesh panel spawned mesh side: 2 ranks"), lines
        assert "[ranks 0-2] where" in lines, lines  # the notebook's mesh, not the panel's
        expect(top).to_be_hidden(timeout=10_000)


def test_the_detached_list_never_calls_a_mesh_attached_to_this_notebook(lab, page, tmp_path):
    """Every text the Detached list shows, from the notebook's first state through a detached
    spawn, a restart of its kernel and an Attach, is recorded in the page as it changes."""
    write_notebook(lab.root / "detached.ipynb", ["side = %mesh spawn -n 2 --detach side", "%mesh stop side"])
    nb = Notebook(page, tmp_path, lab)
    expect = sync_api.expect
    page.add_init_script("""
        window.__detached = [];
        new MutationObserver(() => {
          const d = document.querySelector('.mk-Panel-detached');
          const t = d ? d.innerText : '';
          if (window.__detached[window.__detached.length - 1] !== t) { window.__detached.push(t); }
        }).observe(document, { subtree: true, childList: true, characterData: true });
    """)
    try:
        with nb.step("a detached mesh spawned by this notebook is its own: listed above, not under Detached"):
            open_notebook(nb, lab, "detached.ipynb")
            nb.run_cell(0, timeout=90)
            expect(page.locator(MESH.format("side") + " .mk-Rank")).to_have_count(2, timeout=30_000)
            page.locator(".mk-Panel [data-action='refresh']").click()
            expect(page.locator(".mk-Panel-detached")).to_contain_text("No other detached meshes.", timeout=30_000)

        with nb.step("restart the kernel: side is under Detached, running, with Attach"):
            kernel = rest(lab, "/api/kernels")[1][0]["id"]
            assert rest(lab, f"/api/kernels/{kernel}/restart", "POST")[0] == 200
            row = page.locator(".mk-Panel .mk-Detached[data-mesh='side']")
            expect(row).to_have_count(1, timeout=60_000)
            expect(row).to_contain_text("running", timeout=30_000)
            shot(page, "detached-after-restart")

        with nb.step("Attach: side is listed above again, and never said attached to this notebook"):
            row.locator("[data-action='attach']").click()
            expect(page.locator(MESH.format("side") + " .mk-Rank")).to_have_count(2, timeout=60_000)
            expect(row).to_have_count(0, timeout=30_000)
            deadline = time.monotonic() + 3  # what a late listing might still show
            while time.monotonic() < deadline:
                page.wait_for_timeout(250)
            seen = page.evaluate("() => window.__detached")
            assert seen and not any(re.search("attached to this notebook", t) for t in seen), seen
            nb.run_cell(1)
            expect(page.locator(MESH.format("side"))).to_have_count(0, timeout=30_000)
    finally:
        for m in rest(lab, "/monarch/meshes")[1].get("meshes", []):
            rest(lab, f"/monarch/meshes/{m['name']}", "DELETE")
