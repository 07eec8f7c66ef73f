"""What a user sees in JupyterLab 4: a real server and Debian's headless Chromium, driven
with Playwright, on a notebook that uses the "monarch" kernel.  Cells run on two ranks and
their output shows under rank labels; Tab in a ``%%mesh`` cell pops up names that exist
only on the ranks; a running cell's progress line ticks in place; JupyterLab's own debugger
panel stops rank 1 at a breakpoint clicked into a ``%%mesh`` cell's gutter, shows its call
stack and rank 1's variables, and continues it.  The tests share one server, browser page
and kernel (with its two ranks), which end with the module; nothing here fakes a step it
cannot do (no browser: skip)."""

from __future__ import annotations

import re
import time

import pytest
from support.browser import (
    CHROMIUM,
    DEBUG_BUTTON,
    Lab,
    Notebook,
    load_notebook,
    needs_chromium,
    sync_api,
    write_notebook,
)

pytestmark = [pytest.mark.timeout(240), needs_chromium]
BREAKPOINT_LINE = 5  # ``y = x * 2`` in CELLS[3], counting the magic line as 1
CELLS = [
    "procs = %mesh spawn -n 2",
    "%%mesh\nfrom monarch_kernel import current_rank\nprint('hello from the mesh')\n"
    "print('I am rank', current_rank().rank)",
    "%mesh debug 1",
    "%%mesh --ranks 1\nfrom monarch_kernel import current_rank\nrank = current_rank().rank\n"
    "x = 41 + rank\ny = x * 2\nprint('y is', y)",
    "%%mesh\nmesh_var_alpha, mesh_var_beta = 1, 2",                        # 4: names only the ranks have
    "mesh_var_kernel = 0",                                                 # 5: ... and one only the kernel has
    "",                                                                    # 6: Tab is pressed here
    "%%mesh\nimport time\nprint('sleeping')\ntime.sleep(8)\nprint('awake')",  # 7: the progress line
    "%mesh stop",                                                          # 8: the debugger test ends with it
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, kernelspec):
    root, home = tmp_path_factory.mktemp("notebooks"), tmp_path_factory.mktemp("jupyter")
    server = Lab(root, home)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page():
    with sync_api.sync_playwright() as pw:
        # Root cannot use Chromium's sandbox; the browser only ever loads this test's server.
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 900})
        finally:
            browser.close()


@pytest.fixture(scope="module")
def nb(lab, page, tmp_path_factory):
    """mesh.ipynb open on the monarch kernel, with two ranks spawned (its first cell).  The
    debugger test comes last: it stops the mesh, so rank 1's debug adapter ends with it."""
    write_notebook(lab.root / "mesh.ipynb", CELLS)
    notebook = Notebook(page, tmp_path_factory.mktemp("screenshots"), lab)
    with notebook.step("open the notebook on the monarch kernel and spawn two ranks"):
        load_notebook(notebook, lab.url("mesh.ipynb"))
        notebook.run_cell(0)
    return notebook


def test_tab_in_a_mesh_cell_pops_up_the_ranks_names(nb):
    page, expect = nb.page, nb.expect
    with nb.step("define names on the ranks, and another on the kernel"):
        nb.run_cell(4)
        nb.run_cell(5)

    with nb.step("Tab after `mesh_var_` in a %%mesh cell: the popup lists the ranks' names"):
        cell, typed = nb.cells.nth(6), "%%mesh\nmesh_var_"
        shown = page.locator(".jp-Completer .jp-Completer-item .jp-Completer-match").filter(visible=True)
        # The first Tab may find the rank's completer still starting (the kernel then answers,
        # after 200 ms, from its own namespace); a person presses Tab again.
        deadline = time.monotonic() + 30
        while True:
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Control+A")
            page.keyboard.type(typed)
            page.keyboard.press("Tab")
            try:
                expect(shown.filter(has_text=re.compile(r"^mesh_var_alpha$"))).to_have_count(1, timeout=3_000)
                break
            except AssertionError:
                assert time.monotonic() < deadline, (
                    f"no rank's name in the completer within 30 s; it showed {shown.all_inner_texts()}, "
                    f"the cell reads {cell.locator('.cm-content').inner_text()!r}")
                page.keyboard.press("Escape")
        names = shown.all_inner_texts()
        assert "mesh_var_beta" in names and "mesh_var_kernel" not in names, names
        page.keyboard.press("Escape")
        expect(shown).to_have_count(0, timeout=5_000)


def test_the_progress_line_of_a_running_cell_ticks_in_place(nb):
    expect = nb.expect
    progress = nb.cells.nth(7).locator(".jp-OutputArea-output", has_text="ranks finished")
    with nb.step("an 8 s cell: a progress line shows after 2 s"):
        nb.start_cell(7)
        expect(progress).to_contain_text(re.compile(r"\d of 2 ranks finished \(\d+ s\)"), timeout=30_000)
        first = int(re.search(r"\((\d+) s\)", progress.inner_text()).group(1))

    with nb.step(f"the line moves on from {first} s, replaced in place rather than appended"):
        later = "|".join(str(k) for k in range(first + 1, first + 10))
        expect(progress).to_contain_text(re.compile(rf"ranks finished \((?:{later}) s\)"), timeout=5_000)
        expect(progress).to_have_count(1)
        lines = progress.inner_text().strip().splitlines()  # the stream output it ends
        assert lines[-1].startswith("[mesh] ") and nb.output(7).count("ranks finished") == 1, nb.output(7)
        assert all("ranks finished" not in line for line in lines[:-1]), "the progress line is the cell's last line"

    with nb.step("the cell ends: its output, and no progress line left"):
        out = nb.wait_cell(7, timeout=30)
        # (blanked: a notebook's \r overwrites, so the line after it may end in blanks)
        assert "[ranks 0-1] awake" in [line.rstrip() for line in out.splitlines()] and "ranks finished" not in out, out


def test_a_notebook_runs_on_ranks_and_the_debugger_panel_stops_rank_1(nb):
    page = nb.page

    with nb.step("print on the two ranks"):
        out = nb.run_cell(1)
        lines = out.splitlines()
        assert "[ranks 0-1] hello from the mesh" in lines, out
        assert "[rank 0] I am rank 0" in lines and "[rank 1] I am rank 1" in lines, out

    with nb.step("point the debugger at rank 1 and switch it on"):
        assert "JupyterLab's debugger now debugs rank 1" in nb.run_cell(2)
        page.locator(DEBUG_BUTTON).click()
        page.wait_for_selector(DEBUG_BUTTON + "[aria-pressed='true']", timeout=30_000)
        page.wait_for_selector(".jp-DebuggerSidebar .jp-DebuggerCallstack", timeout=30_000)

    with nb.step(f"click the gutter of line {BREAKPOINT_LINE} of the %%mesh --ranks 1 cell"):
        cell = nb.cells.nth(3)
        nb.click_breakpoint_gutter(cell, BREAKPOINT_LINE)
        bp = page.locator(".jp-DebuggerBreakpoints-body .jp-DebuggerBreakpoint")
        nb.expect(bp).to_have_count(1, timeout=15_000)
        nb.expect(bp.locator(".jp-DebuggerBreakpoint-line")).to_have_text(str(BREAKPOINT_LINE))
        nb.expect(cell.locator(".cm-breakpoint-gutter .cm-breakpoint-icon").filter(visible=True)).to_have_count(1)

    with nb.step("run the cell: rank 1 stops at the breakpoint"):
        nb.start_cell(3)
        page.wait_for_selector(".jp-DebuggerPausedOverlay", timeout=30_000)

    with nb.step("the Callstack shows the stopped frame and Variables rank 1's values"):
        frame = page.locator(".jp-DebuggerCallstack .jp-DebuggerCallstackFrame").first
        nb.expect(frame.locator(".jp-DebuggerCallstackFrame-location")).to_contain_text(
            f":{BREAKPOINT_LINE}", timeout=15_000)
        nb.expect(cell.locator(".jp-DebuggerEditor-highlight")).to_have_count(1, timeout=15_000)
        names = page.locator(".jp-DebuggerVariables .jp-DebuggerVariables-name").filter(visible=True)
        x = names.filter(has_text=re.compile(r"^x$"))
        value = x.locator("xpath=following-sibling::*[contains(@class, 'jp-DebuggerVariables-detail')][1]")
        nb.expect(value).to_have_text("42", timeout=15_000)  # 41 + rank, on rank 1
        names = names.all_inner_texts()
        assert "rank" in names and "y" not in names, names  # rank 1's namespace, before line 5 ran
        assert nb.cells.nth(3).locator(".jp-InputPrompt").inner_text().strip() == "[*]:"

    with nb.step("Continue: the cell finishes with rank 1's output"):
        page.locator(".jp-DebuggerSidebar jp-button[data-command='debugger:continue']").click()
        out = nb.wait_cell(3)
        assert "[rank 1] y is 84" in out.splitlines(), out
        nb.expect(page.locator(".jp-DebuggerPausedOverlay")).to_have_count(0, timeout=15_000)

    with nb.step("the debugger off, then %mesh stop: the ranks, and the debug adapter rank 1 started, end"):
        page.locator(DEBUG_BUTTON).click()
        page.wait_for_selector(DEBUG_BUTTON + "[aria-pressed='false']", timeout=30_000)
        assert "stopped" in nb.run_cell(8), nb.output(8)


def test_a_theme_whose_css_does_not_load_fails_the_load_naming_the_request(lab, page, tmp_path):
    """The theme's CSS answered 503 (as a server might under load): JupyterLab's "Error Loading
    Theme" dialog is not waited past; the failure names the request, its URL and status."""
    write_notebook(lab.root / "theme.ipynb", [""])
    other = page.context.browser.new_page()
    try:
        other.route("**/lab/api/themes/**/index.css", lambda route: route.fulfill(status=503, body="busy"))
        with pytest.raises(AssertionError) as info:
            load_notebook(Notebook(other, tmp_path, lab), lab.url("theme.ipynb"))
    finally:
        other.close()
    said = str(info.value)
    assert "'Error Loading Theme Stylesheet failed to load: " in said, said
    assert re.search(r"GET http://127\.0\.0\.1:\d+/lab/api/themes/@jupyterlab/theme-light-extension/index\.css: "
                     r"HTTP 503", said), said
