"""The docs site, built with ``mkdocs build --strict`` and opened in a real headless browser (Debian's chromium).

The site is built from the executed notebooks (``notebooks/execute.py``: reused when they match the current
notebook and package sources, executed here otherwise; in one pytest run each notebook executes once, shared with
``test_notebooks.py``), served over HTTP on 127.0.0.1, and opened with selenium + chromedriver. The quickstart page
must render its top-k table and draw the layer x head heatmap with the site's own plotly.js. A screenshot of the
quickstart page is kept as a CI artifact: ``artifacts/quickstart.png`` (and ``artifacts/quickstart-heatmap.png``).

Skips only when chromium or chromedriver is not installed (``make test`` installs both with apt).
"""

from __future__ import annotations

import base64
import functools
import http.server
import inspect
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import notebook_runner

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and os.path.exists(p)), None)
CHROMEDRIVER = next((p for p in (shutil.which("chromedriver"), "/usr/bin/chromedriver") if p and os.path.exists(p)), None)
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1280,1600",
    "--hide-scrollbars",
)
NOTEBOOK_PAGES = ["quickstart/", "how-it-works/", "heads-and-neurons/", "which-token/", "why-the-head-attended/",
                  "every-position/", "what-the-model-says/", "a-dataset/", "families/", "remote/",
                  "attribute-direction/", "ablate-patch-steer/", "gallery/"]
PAGES = ["", *NOTEBOOK_PAGES, "family-table/", "layout/", "api/"]

_HAS_BROWSER = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)",
)


def needs_browser(test):
    """A test of this module: skipped without chromium, marked ``browser``, and ``notebooks``, ``real`` and
    ``server`` too when it reads the built site (the ``site`` or ``server`` fixture: the site is built from the
    executed notebooks and recipes, which run the default model, the remote recipe on a loopback NDIF server)."""
    marks = [_HAS_BROWSER, pytest.mark.browser]
    if {"site", "server"} & set(inspect.signature(test).parameters):
        marks += [pytest.mark.notebooks, pytest.mark.real, pytest.mark.server]
    for mark in marks:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built by ``mkdocs build --strict`` from executed notebooks; fails on any warning."""
    runner = notebook_runner()
    results = runner.execute_all(reuse=True, log=lambda line: print(f"[notebooks] {line}"))
    failed = [f"{r.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "notebooks failed, so the site cannot be built:\n" + "\n\n".join(failed)
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    started = time.perf_counter()
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(out)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    log = build.stdout + build.stderr
    print(f"[mkdocs] build --strict: exit {build.returncode} in {time.perf_counter() - started:.1f} s")
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    warnings = [line for line in log.splitlines() if re.match(r"^(WARNING|ERROR)\b", line)]
    assert not warnings, "\n".join(warnings)
    return out


@pytest.fixture(scope="module")
def server(site):
    """The built site over HTTP on 127.0.0.1 (a free port), stopped after the module."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output readable
        pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium manager look for a driver online
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, timeout=30.0, what="condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition, message=f"timed out after {timeout}s waiting for {what}")


def _page_errors(driver) -> list[str]:
    """Severe console messages of the page, less failed loads of external resources (the CI machine is offline)."""
    errors = []
    for entry in driver.get_log("browser"):
        if entry.get("level") != "SEVERE":
            continue
        message = entry.get("message", "")
        if "net::ERR_" in message or "Failed to load resource" in message:
            continue
        errors.append(message)
    return errors


@pytest.mark.slow  # a fresh interpreter: its imports alone take ~7 s of CPU
def test_plots_keep_plotly_optional():
    """``dla_recipes.plots`` imports plotly and matplotlib only inside its functions."""
    code = "import sys, dla_recipes, dla_recipes.plots; print(sorted({'plotly', 'matplotlib'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


@needs_browser
def test_site_files(site):
    """Every page of the nav is built, plotly.js ships with the site, and every plot carries its static fallback."""
    for page in PAGES:
        assert (site / page / "index.html").is_file(), f"page {page or 'index'} is missing"
    assert (site / "assets" / "javascripts" / "plotly.min.js").stat().st_size > 1_000_000
    quickstart = (site / "quickstart" / "index.html").read_text(encoding="utf-8")
    plots = re.findall(r'<div class="dla-plot" data-dla-plot="([a-z_]+)"><img [^>]*class="dla-plot-static"', quickstart)
    assert {"blocks_bar", "heads_heatmap"} <= set(plots), plots
    assert 'id="heads-heatmap"' in quickstart and 'class="dla-top-table"' in quickstart


@needs_browser
def test_quickstart_renders_table_and_heatmap(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server + "quickstart/")
    _wait(browser, lambda d: d.execute_script("return document.readyState") == "complete", what="the page to load")
    assert "Quickstart" in browser.title

    # the top-k table: component labels, signed values, shares
    tables = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "table.dla-top-table"), what="top-k tables")
    first = tables[0]
    headers = [th.text.strip() for th in first.find_elements(By.CSS_SELECTOR, "thead th")]
    assert headers == ["component", "value", "share", ""], headers  # the bars in a last column of their own
    rows = [[td.text.strip() for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in first.find_elements(By.CSS_SELECTOR, "tbody tr")]
    assert len(rows) == 10, rows
    for component, value, share, bar in rows:
        assert re.fullmatch(r"embed|L\d+\.\w+", component), component
        assert re.fullmatch(r"[+-]\d+\.\d{4}", value), value
        assert share.endswith("%"), share
        assert bar == "", bar
    # no bar is drawn behind a number: the value cells carry no background gradient
    value_cells = first.find_elements(By.CSS_SELECTOR, "tbody td:nth-child(2)")
    assert not [c for c in value_cells if "gradient" in c.value_of_css_property("background-image")]
    bar_cells = first.find_elements(By.CSS_SELECTOR, "tbody td:nth-child(4)")
    assert all("gradient" in c.value_of_css_property("background-image") for c in bar_cells)
    assert first.is_displayed() and first.size["height"] > 100

    # the heatmap: drawn by the site's plotly.js into the div with the known id, the static PNG removed
    heatmap = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#heads-heatmap.js-plotly-plot"),
                    what="plotly to draw #heads-heatmap")[0]
    assert heatmap.find_elements(By.CSS_SELECTOR, "g.hm image, .heatmaplayer"), "no heatmap layer in the plot"
    wrapper = browser.find_element(By.CSS_SELECTOR, '[data-dla-plot="heads_heatmap"]')
    assert not wrapper.find_elements(By.CSS_SELECTOR, "img.dla-plot-static")
    assert heatmap.size["width"] > 300 and heatmap.size["height"] > 300
    ticks = {t.text for t in heatmap.find_elements(By.CSS_SELECTOR, ".ytick text")}
    assert {"L0", "L29"} <= ticks, sorted(ticks)

    # screenshots kept as CI artifacts
    ARTIFACTS.mkdir(exist_ok=True)
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", heatmap)
    time.sleep(0.5)
    heatmap_png = ARTIFACTS / "quickstart-heatmap.png"
    wrapper.screenshot(str(heatmap_png))
    page_png = ARTIFACTS / "quickstart.png"
    _full_page_screenshot(browser, page_png, max_height=9000)
    print(f"screenshot: {page_png.relative_to(ROOT)} (heatmap: {heatmap_png.relative_to(ROOT)})")
    assert page_png.stat().st_size > 10_000 and heatmap_png.stat().st_size > 5_000
    assert not _page_errors(browser)


@needs_browser
def test_static_fallback_without_javascript(server, browser):
    """Where plotly.js cannot run (scripts disabled here), each plot shows its static PNG instead."""
    from selenium.webdriver.common.by import By

    browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})
    try:
        browser.get(server + "quickstart/")
        images = browser.find_elements(By.CSS_SELECTOR, '[data-dla-plot="heads_heatmap"] img.dla-plot-static')
        assert images, "no static heatmap image"
        image = images[0]
        assert image.is_displayed()
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) > 300
        assert not browser.find_elements(By.CSS_SELECTOR, ".js-plotly-plot"), "plotly ran with scripts disabled?"
        assert browser.find_elements(By.CSS_SELECTOR, "table.dla-top-table"), "the tables need no script"
    finally:
        browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": False})


def _full_page_screenshot(driver, path: Path, max_height: int) -> None:
    """The whole page (up to ``max_height`` px) through the DevTools protocol."""
    width = driver.execute_script("return document.documentElement.scrollWidth")
    height = min(max_height, driver.execute_script("return document.documentElement.scrollHeight"))
    driver.execute_script("window.scrollTo(0, 0)")
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {
        "format": "png", "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
    })
    path.write_bytes(base64.b64decode(shot["data"]))


@needs_browser
@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_its_plots(server, browser, page):
    """Each page loads without script errors, and plotly draws every plot on it."""
    from selenium.webdriver.common.by import By

    browser.get(server + page)
    _wait(browser, lambda d: d.execute_script("return document.readyState") == "complete", what=f"{page} to load")
    assert browser.find_elements(By.CSS_SELECTOR, "article h1"), f"{page}: no title"
    plots = browser.find_elements(By.CSS_SELECTOR, ".dla-plot")
    if plots:
        _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".dla-plot .js-plotly-plot")) == len(plots),
              what=f"plotly to draw the {len(plots)} plots of {page}")
    errors = _page_errors(browser)
    assert not errors, f"{page}: {errors}"


@needs_browser
def test_every_notebook_page_offers_its_notebook(server, browser):
    """Under each notebook page's title, a link to its .ipynb (no outputs) that the site serves and nbformat reads."""
    import urllib.request

    import nbformat
    from selenium.webdriver.common.by import By

    for page in NOTEBOOK_PAGES:
        browser.get(server + page)
        links = browser.find_elements(By.CSS_SELECTOR, "article .dla-download a[download]")
        assert len(links) == 1, f"{page}: {len(links)} download links"
        href = links[0].get_attribute("href")
        assert href.endswith(f"/notebooks/{page.strip('/')}.ipynb"), href
        assert links[0].is_displayed()
        with urllib.request.urlopen(href, timeout=30) as response:
            nb = nbformat.reads(response.read().decode("utf-8"), as_version=4)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert code and not any(cell.outputs for cell in code), f"{page}: the download should carry no outputs"


@needs_browser
def test_gallery_page(server, browser):
    """The gallery shows every recipe: heading, code, outputs, and .py / .ipynb downloads that resolve."""
    import urllib.request

    import nbformat
    from selenium.webdriver.common.by import By

    runner = notebook_runner()
    recipes = [runner.read_recipe(path) for path in runner.recipes()]
    browser.get(server + "gallery/")
    _wait(browser, lambda d: d.execute_script("return document.readyState") == "complete", what="the gallery")
    headings = [h.text.replace("¶", "").strip() for h in browser.find_elements(By.CSS_SELECTOR, "article h2")]
    assert headings == [r.title for r in recipes], headings
    body = browser.find_element(By.TAG_NAME, "article").text
    for recipe in recipes:
        assert recipe.summary in body, recipe.name
        for suffix in (".py", ".ipynb"):
            link = browser.find_element(By.CSS_SELECTOR, f'a[href$="recipes/{recipe.name}{suffix}"]')
            with urllib.request.urlopen(link.get_attribute("href"), timeout=30) as response:
                data = response.read().decode("utf-8")
            if suffix == ".py":
                assert data == recipe.path.read_text(encoding="utf-8")
            else:
                assert nbformat.reads(data, as_version=4).cells[0].source == recipe.code
    # each recipe's cell: its code and its outputs (the per-block bar chart of the first recipe, drawn by plotly)
    cells = browser.find_elements(By.CSS_SELECTOR, ".jp-CodeCell[id^='cell-id']")  # nbconvert nests two divs a cell
    assert len(cells) == len(recipes)
    assert all(cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output") for cell in cells)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '[data-dla-plot="blocks_bar"] .js-plotly-plot'),
          what="plotly to draw the first recipe's bar chart")
    table = browser.find_element(By.CSS_SELECTOR, "article table")  # the recipe index, with each recipe's time
    assert len(table.find_elements(By.CSS_SELECTOR, "tbody tr")) == len(recipes)
    assert not _page_errors(browser)


@needs_browser
def test_families_table_fits_the_page(server, browser):
    """The exactness table (two header rows, compact cells) is no wider than the article: no sideways scroll."""
    from selenium.webdriver.common.by import By

    browser.get(server + "families/")
    table = browser.find_element(By.CSS_SELECTOR, "table.dla-compact")
    area = browser.execute_script("return arguments[0].closest('.jp-OutputArea-output')", table)
    assert table.size["width"] <= browser.find_element(By.CSS_SELECTOR, "article").size["width"], table.size
    assert browser.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth + 1", area)


@needs_browser
@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_table_of_contents_links_land(server, browser, page):
    """Every table-of-contents link of a notebook page points at an element of that page."""
    from selenium.webdriver.common.by import By

    browser.get(server + page)
    anchors = [a.get_attribute("href").split("#", 1)[1]  # the TOC: in-page links of the navigation
               for a in browser.find_elements(By.CSS_SELECTOR, "a.md-nav__link")
               if a.get_attribute("href").split("#", 1)[0] == browser.current_url.split("#", 1)[0]
               and "#" in a.get_attribute("href")]
    assert anchors, f"{page}: no table of contents found"
    missing = [a for a in set(anchors) if not browser.find_elements(By.ID, a)]
    assert not missing, f"{page}: table-of-contents anchors with no target: {missing}"


# -- the heatmaps' titles: above their top x axis, never on it (drawn by plotly.js in the browser, no site) ----------

BOXES_JS = """
const boxes = {};
for (const [name, selector] of Object.entries({title: '.gtitle', xtitle: '.xtitle', xticks: '.xtick text'})) {
  for (const element of document.querySelectorAll(selector)) {
    const r = element.getBoundingClientRect();
    if (!r.width) continue;
    const b = boxes[name];
    boxes[name] = b ? {top: Math.min(b.top, r.top), bottom: Math.max(b.bottom, r.bottom), left: Math.min(b.left, r.left),
                       right: Math.max(b.right, r.right)} : {top: r.top, bottom: r.bottom, left: r.left, right: r.right};
  }
}
return boxes;
"""


def _drawn_boxes(browser, fig, folder: Path) -> dict:
    """The screen boxes of ``fig``'s title, x-axis title and x tick labels, drawn by the installed plotly.js."""
    import plotly

    plotly_js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    page = folder / "figure.html"
    page.write_text(f'<html><head><script>{plotly_js}</script></head><body style="margin:0">'
                    f'<div id="figure" style="width:{fig.layout.meta["static_width"]}px"></div><script>'
                    f'const spec = {fig.to_json()}; Plotly.newPlot("figure", spec.data, spec.layout)'
                    '.then(() => { document.title = "drawn"; });</script></body></html>', encoding="utf-8")
    browser.get(page.as_uri())
    _wait(browser, lambda d: d.title == "drawn", what="plotly to draw the figure")
    return browser.execute_script(BOXES_JS)


def _overlap(a: dict, b: dict) -> bool:
    return a["bottom"] > b["top"] and a["top"] < b["bottom"] and a["right"] > b["left"] and a["left"] < b["right"]


@needs_browser
def test_heatmap_titles_clear_their_top_axis(browser, tmp_path):
    """The which-token heatmap (``sources_heatmap``: rotated token labels on top, one prompt or the mean) and the
    heads heatmap put the x axis on top; the figure's title must sit above its axis title and tick labels, inside
    the figure (measured: plotly's default title placement put the title on the axis title)."""
    import torch

    from dla_recipes import Attribution, plots

    def attribution(labels, by):
        values = torch.randn(2, len(labels), generator=torch.Generator().manual_seed(0))
        return Attribution(values=values, labels=labels, constant=torch.zeros(2), logit=values.sum(-1),
                           output_logit=values.sum(-1), error=0.0, by=by, family="gemma3_text",
                           target_tokens=(" Paris",) * 2, contrast_tokens=(" Rome",) * 2, prompts=("a", "b"))

    figures = []
    for tokens in (["<bos>", "The", " E", "iff", "el", " Tower", " is", " in", " the", " city", " of"],
                   ["<|im_start|>", " supercalifragilistic", " antidisestablishment"], ["a"]):
        labels = ["embed"] + [f"L{i}.H{h}.S{s}" for i in range(3) for h in range(4) for s in range(len(tokens))]
        for prompt in (0, None):
            figures.append(plots.sources_heatmap(attribution(labels, "source"), tokens, prompt=prompt, k=10))
    for layers, heads in ((30, 9), (2, 4)):
        labels = ["embed"] + [f"L{i}.H{h}" for i in range(layers) for h in range(heads)]
        figures.append(plots.heads_heatmap(attribution(labels, "head")))
    for fig in figures:
        boxes = _drawn_boxes(browser, fig, tmp_path)
        assert {"title", "xtitle", "xticks"} <= set(boxes), boxes
        title = boxes["title"]
        assert title["top"] >= 0 and title["bottom"] <= boxes["xtitle"]["top"], (fig.layout.title.text, boxes)
        assert not _overlap(title, boxes["xticks"]), (fig.layout.title.text, boxes)
