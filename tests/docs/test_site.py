"""The documentation site, built once as ``make docs`` builds it (Sphinx with -W and nitpicky,
every notebook and every guide's code cells run on the monarch kernel; the notebooks that
tests/system/test_notebooks.py ran just before on this worker are not run again), then read: every
internal link and image of every page resolves, every public name's page shows its docstring
with an example, the reference carries every setting and every ``%mesh`` subcommand, and in
headless Chromium the home page, a guide, an API page and an executed notebook render with no
missing image, and the search finds ``spawn_procs``."""

from __future__ import annotations

import functools
import html
import http.server
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from support.browser import CHROMIUM, needs_chromium, sync_api

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The build runs the guides' cells, and the six notebooks unless tests/system/test_notebooks.py ran
# them just before on this worker (conftest.py puts them in one unit, that module first): about 2
# minutes alone on 2 cores with the notebooks, longer beside the rest of the suite.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def site(executed_notebooks):
    """The site, built into a temporary folder as ``make docs`` builds docs/_build/html, but for
    the notebooks the notebooks' tests ran clean in this session: their outputs are taken
    (docs/_ext/mk_executed.py) instead of running them a second time."""
    where = Path(tempfile.mkdtemp(prefix="mk-docs-"))
    reused = sorted(p.stem for p in executed_notebooks.glob("*.ipynb"))
    try:
        started = time.monotonic()
        built = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html",
                                str(DOCS), str(where / "html"), "-d", str(where / "doctrees")],
                               cwd=ROOT, capture_output=True, text=True, timeout=840,
                               env=dict(os.environ, MONARCH_KERNEL_DOCS_EXECUTED=str(executed_notebooks)))
        print(f"the docs built in {time.monotonic() - started:.0f} s, the notebooks' outputs taken from "
              f"tests/system/test_notebooks.py for {reused or 'none (they ran in the build)'}")
        assert built.returncode == 0, f"the docs build failed:\n{built.stdout[-6000:]}\n{built.stderr[-10000:]}"
        yield where / "html"
    finally:
        shutil.rmtree(where, ignore_errors=True)


# ---------------------------------------------------------------- read from the files

LINK = re.compile(r"""<(?:a|link)\b[^>]*?\bhref="([^"]*)"|<(?:img|script)\b[^>]*?\bsrc="([^"]*)\"""")
ANCHOR = re.compile(r"""\bid="([^"]+)\"""")


@functools.cache
def anchors(page: Path) -> frozenset[str]:
    return frozenset(html.unescape(a) for a in ANCHOR.findall(page.read_text(errors="replace")))


def internal_links(page: Path):
    """(target, what the page wrote) for every link, image and script of ``page`` inside the site."""
    for href, src in LINK.findall(page.read_text(errors="replace")):
        ref = html.unescape(href or src)
        parts = urllib.parse.urlsplit(ref)
        if parts.scheme or ref.startswith("//") or not ref:
            continue  # an external link (not checked: no internet here), or none
        yield parts, ref


def broken_links(site: Path) -> list[str]:
    """Every link, image or script of the site's pages whose file, or anchor, is not there."""
    broken = []
    pages = [p for p in sorted(site.rglob("*.html")) if "_static" not in p.relative_to(site).parts]  # not the theme's
    for page in pages:
        for parts, ref in internal_links(page):
            target = (page.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {ref} (no such file)")
            elif (parts.fragment and target.suffix == ".html"
                  and urllib.parse.unquote(parts.fragment) not in anchors(target)):
                broken.append(f"{page.relative_to(site)}: {ref} (no such anchor)")
    return broken


def test_every_internal_link_and_image_resolves(site):
    broken = broken_links(site)
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:40])


def test_the_link_check_sees_a_missing_page_anchor_and_image(tmp_path):
    (tmp_path / "a.html").write_text('<h1 id="top">A</h1><a href="b.html#top">b</a><a href="#top">up</a>'
                                     '<a href="https://example.org/x">out</a>')
    (tmp_path / "b.html").write_text('<p id="top"></p><a href="a.html#nowhere">a</a><a href="gone.html">gone</a>'
                                     '<img src="p.png">')
    assert broken_links(tmp_path) == ["b.html: a.html#nowhere (no such anchor)", "b.html: gone.html (no such file)",
                                      "b.html: p.png (no such file)"]


def public_names() -> list[tuple[str, str]]:
    """(module, name) of every public name, as the API page lists them (docs/_ext/mk_generated.py)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        generated = importlib.import_module("mk_generated")
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    names = [(module, n) for _title, module, found, _what in generated.sections() for n in found]
    import monarch_kernel

    assert {n for m, n in names if m == "monarch_kernel"} == set(monarch_kernel.__all__)
    return names


def test_every_public_name_renders_its_docstring_with_an_example(site):
    missing = []
    for module, name in public_names():
        page = site / "reference" / "_api" / f"{module}.{name}.html"
        if not page.is_file():  # a name exported twice has the page of its first name
            continue
        text = page.read_text()
        # the object's own description: from its first <dd> to its first member's <dl>, if any
        start = text.find("<dd>", text.find('<dl class="py'))
        end = text.find('<dl class="py', start)
        own = text[start:end if end > 0 else None] if start > 0 else ""
        if '<div class="highlight' not in own:  # an example is a code block of the docstring
            missing.append(f"{module}.{name}")
    pages = {p.name for p in (site / "reference" / "_api").glob("*.html")}
    assert "monarch_kernel.HostMesh.html" in pages and "monarch_kernel.job.SSHJob.html" in pages, sorted(pages)[:20]
    assert not missing, f"no docstring example rendered for: {missing}"


def text_of(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def test_the_reference_carries_every_setting_and_every_magic(site):
    from monarch_kernel.kernel import magic_args
    from monarch_kernel.runtime import config

    settings = text_of(site / "reference" / "settings.html")
    absent = [s.env or s.name for s in config.SETTINGS.values() if (s.env or s.name) not in settings]
    assert not absent, f"settings the docs do not show: {absent}"
    magics = text_of(site / "reference" / "magics.html")
    for name in magic_args.COMMANDS:
        assert magic_args.usage(magic_args.COMMANDS[name]) in " ".join(magics.split()), name
    rest = text_of(site / "reference" / "rest.html")
    assert "/monarch/meshes/{name}/attach" in rest


def test_examples_ran_at_build_time(site):
    """The outputs on the pages are this build's: the notebooks' and the guides' cells ran."""
    assert "[ranks 0-3] hello from the mesh" in text_of(site / "notebooks" / "quickstart.html")
    assert "[ranks 0-3] hello" in text_of(site / "guides" / "notebook.html")
    assert re.search(r"ValueMesh\(\{'gpus': 4\}", text_of(site / "get-started.html"))  # the ten lines' output
    assert "'AgentLink'" in text_of(site / "how-it-works.html")
    assert "DeviceMesh<{'dp': 2, 'tp': 2} cpu on 'procs'>" in text_of(site / "guides" / "training.html")
    assert "Stacks of mesh 'procs': 4 ranks in 2 groups" in text_of(site / "guides" / "observing.html")
    healing = text_of(site / "guides" / "self-healing.html")
    assert "restart (1,) ('killed by signal 9 (SIGKILL)',)" in healing  # a rank SIGKILLed, replaced
    assert "HangError: no progress on mesh 'procs'" in healing and "[ranks 0-1] every rank answers" in healing
    assert re.search(r"\[\('replaced', \(1,\), 2\)\]", healing), "elastic_run replaced no rank"
    # Outputs that need other hosts were recorded on simulated ones, and say where and when.
    remote = text_of(site / "guides" / "beyond-one-machine.html")
    assert len(re.findall(r"Recorded 20\d\d-\d\d-\d\d \d\d:\d\d UTC on ", remote)) == 4, remote[:2000]
    assert "rank 3: mk-h2" in remote  # SSH (and the workers)
    assert len(re.findall(r"rank 3: mkn2, Slurm job \d+", remote)) == 2  # Slurm, from a login node and from outside


# ---------------------------------------------------------------- in a browser


@pytest.fixture(scope="module")
def served(site):
    """The site over HTTP on a free local port (a thread of this process), as a host serves it."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def browser_page():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


BROKEN_IMAGES = "() => [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"


def visit(page, url: str) -> str:
    """Open ``url``, fail on a missing image or a 404 of anything it loads; its text."""
    failed: list[str] = []
    page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    answer = page.goto(url, wait_until="load")
    assert answer is not None and answer.ok, f"{url}: {answer and answer.status}"
    page.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=30_000)
    assert page.evaluate(BROKEN_IMAGES) == [], f"{url}: missing images"
    assert not failed, f"{url}: {failed}"
    return page.inner_text("body")


@needs_chromium
def test_pages_render_in_a_browser(served, browser_page):
    home = visit(browser_page, f"{served}/index.html")
    assert "monarch-kernel" in browser_page.title() and "single controller" in home
    assert browser_page.locator("img[src$='mesh-panel.png']").count() == 1
    guide = visit(browser_page, f"{served}/guides/notebook.html")
    assert "[ranks 0-3] hello" in guide
    api = visit(browser_page, f"{served}/reference/_api/monarch_kernel.HostMesh.html")
    assert "spawn_procs" in api and "Example" in api
    notebook = visit(browser_page, f"{served}/notebooks/ddp.html")
    assert browser_page.locator("article img").count() >= 1, "the DDP notebook's plot is not on its page"
    assert "resumed after step" in notebook


@needs_chromium
def test_the_search_finds_spawn_procs(served, browser_page):
    visit(browser_page, f"{served}/search.html?q=spawn_procs")
    results = browser_page.locator("#search-results ul.search li")
    results.first.wait_for(timeout=30_000)
    found = results.all_inner_texts()
    assert any("HostMesh" in r or "spawn_procs" in r for r in found), found
