"""The site's benchmark charts and tables: charts drawn at build time from the results files they
name, and tables that fit the text column.

* Every image on every page of the built site exists in the site.
* Each chart (``charts/NAME.svg``) names its results file and that file's sha256 in its metadata,
  and both match the file as it is now (a stale or hand-made chart fails); the numbers written on
  its bars are those of the file, read here from the JSON independently of ``docs/charts.py``.
* A results file that does not exist gives "Not measured yet" and no chart.
* No table is wider than the text column at a 1280 px window, and no ratio cell wraps: measured in
  headless Chromium where it is installed (``apt-get install chromium``; without it that test
  skips), and, everywhere, estimated from the generated Markdown with a conservative budget
  (:func:`min_table_width`).
"""

from __future__ import annotations

import hashlib
import html
import importlib.util
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO
from strict_skips import require_module

RESULTS = REPO / "benchmarks" / "results"
SVG = "{http://www.w3.org/2000/svg}"
DC = "{http://purl.org/dc/elements/1.1/}"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"test_docs_{name}", REPO / "docs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load("hooks")


def _svg_facts(svg: bytes) -> tuple[str, str, list[str]]:
    """(``dc:source``, ``dc:identifier``, every ``<text>``'s text) of a chart."""
    root = ET.fromstring(svg)
    source = root.find(f".//{DC}source")
    identifier = root.find(f".//{DC}identifier")
    assert source is not None and identifier is not None, "the chart does not say what it was drawn from"
    texts = ["".join(t.itertext()).strip() for t in root.iter(f"{SVG}text")]
    return str(source.text), str(identifier.text), texts


def _expected_labels(name: str, results: dict[str, Any]) -> list[str]:
    """The values the chart of ``name`` must show, from the JSON: img/s of each plotted row (engine
    variants without settings), or the median seconds of each variant, to 3 significant figures."""
    if name == "bench_first_prediction":
        return [f"{row['median_s']:.3g} s" for row in results["rows"]]
    return [f"{row['img_per_s']:.3g}" for row in results["rows"] if len(row["variant"].split("(")[0].split()) == 2]


def _check_chart(svg: bytes, results_file: Path) -> None:
    source, identifier, texts = _svg_facts(svg)
    assert (REPO / source).resolve() == results_file.resolve(), (source, results_file)
    assert identifier == "sha256:" + hashlib.sha256(results_file.read_bytes()).hexdigest(), \
        f"the chart of {source} was drawn from another version of it"
    name = results_file.stem
    expected = _expected_labels(name, json.loads(results_file.read_bytes())["results"])
    assert expected
    missing = [label for label in expected if label not in texts]
    assert not missing, f"{name}'s chart lacks the values {missing}"


# --- drawing, without MkDocs -----------------------------------------------------------------------


def test_a_chart_names_its_source_and_shows_its_numbers(tmp_path: Path) -> None:
    require_module("matplotlib", extra="docs")
    name = "bench_first_prediction"
    path = tmp_path / f"{name}.json"
    record = json.loads((RESULTS / f"{name}.json").read_bytes()) if (RESULTS / f"{name}.json").is_file() else None
    if record is None:
        pytest.skip(f"{name}.json not measured")
    record["results"]["rows"][0].update(median_s=1.2345, seconds_all_rounds=[1.2, 1.2345, 1.3])  # no real run's
    path.write_text(json.dumps(record))
    svg = hooks.charts.chart_svg(name, path, str(path))
    source, identifier, texts = _svg_facts(svg)
    assert source == str(path) and "1.23 s" in texts
    assert identifier == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_text(json.dumps(record, indent=1))  # the same numbers, other bytes: the chart is stale
    with pytest.raises(AssertionError, match="another version"):
        _check_chart(svg, path)


def test_a_missing_results_file_has_no_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("mkdocs", extra="docs")
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files

    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setenv(hooks.RESULTS_DIR_ENV, str(results))
    shutil.copy(RESULTS / "bench_inference.json", results / "bench_inference.json")
    config = MkDocsConfig()
    config.load_dict({"site_name": "t", "docs_dir": str(REPO / "docs"), "site_dir": str(tmp_path / "site")})
    assert config.validate() == ([], [])
    config.plugins._current_plugin = None  # as MkDocs sets it while it runs the hooks
    files = hooks.on_files(Files([]), config=config)
    assert [f.src_uri for f in files] == ["charts/bench_inference.svg"]
    page = hooks.on_page_markdown("<!-- results: bench_engines -->\n\n<!-- results: bench_inference -->\n",
                                  page=None, config=None, files=None)
    assert page.startswith('!!! note "Not measured yet"') and "charts/bench_engines.svg" not in page
    assert "![Chart of bench_inference.json](charts/bench_inference.svg)" in page


# --- the built site ---------------------------------------------------------------------------------


@pytest.fixture
def site(built_site: Path) -> Path:
    return built_site


@pytest.mark.slow
def test_every_image_on_every_page_exists_and_every_chart_matches_its_file(site: Path) -> None:
    charts_seen = set()
    for html in site.rglob("*.html"):
        for src in re.findall(r'<img[^>]*\ssrc="([^"]+)"', html.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", src):
                continue  # data: or remote: nothing to find in the site (and the site links none)
            image = (html.parent / src.split("#")[0]).resolve()
            assert image.is_file(), f"{html.relative_to(site)} shows {src}, which the site lacks"
            if image.parent == (site / "charts").resolve():
                charts_seen.add(image.stem)
                _check_chart(image.read_bytes(), RESULTS / f"{image.stem}.json")
    measured = {name for name in hooks.charts.CHARTS if (RESULTS / f"{name}.json").is_file()}
    assert charts_seen == measured  # each measured file with a chart is shown, and only those
    assert {"bench_engines", "bench_inference", "bench_first_prediction"} <= measured


@pytest.mark.slow
def test_each_chart_is_between_its_table_and_that_tables_provenance(site: Path) -> None:
    page = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    for name in hooks.charts.CHARTS:
        if not (RESULTS / f"{name}.json").is_file():
            continue
        image = page.index(f'src="../charts/{name}.svg"')
        # The image's own paragraph, then the next one: the provenance line of the table above.
        after = page[image:page.index("</p>", page.index("</p>", image) + 4)]
        before = page[page.rindex("</table>", 0, image):image]
        assert "<h2" not in before and "<h3" not in before, name
        command = json.loads((RESULTS / f"{name}.json").read_bytes())["command"]
        assert command in html.unescape(re.sub(r"<[^>]+>", "", after)), name


# --- tables that fit ---------------------------------------------------------------------------------

#: Material for MkDocs at a 1280 px window (both sidebars shown): the article's text column is 688 px;
#: a header cell is at least 5rem = 100 px wide; cells have 16 px of padding left and right; table
#: text is 12.8 px (0.64rem) in the system sans-serif. Measured in Chromium on the built site.
TEXT_COLUMN_PX = 688
MIN_COLUMN_PX = 100
CELL_PADDING_PX = 32
#: A conservative width per character: 0.6 em of 12.8 px (digits and lower case average about 0.55 em).
CHAR_PX = 0.6 * 12.8


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def min_table_width(lines: list[str]) -> float:
    """The narrowest a Markdown table can be laid out: per column, its longest word (a browser
    breaks cells only at spaces; inline code may break anywhere, docs/stylesheets/tables.css) plus
    padding, and at least :data:`MIN_COLUMN_PX`."""
    rows = [_cells(line) for line in lines if not re.match(r"^\|[-:| ]+\|$", line.strip())]
    width = 0.0
    for column in zip(*rows):
        words = [w for cell in column for w in re.sub(r"`[^`]*`", " ", re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", cell)).split()]
        width += max(MIN_COLUMN_PX, CELL_PADDING_PX + CHAR_PX * max(map(len, words), default=0))
    return width


def _markdown_tables(markdown: str) -> list[list[str]]:
    tables: list[list[str]] = []
    previous = False
    for line in markdown.splitlines():
        is_row = line.startswith("|")
        if is_row and not previous:
            tables.append([])
        if is_row:
            tables[-1].append(line)
        previous = is_row
    return tables


def test_the_budget_flags_a_table_that_overflowed() -> None:
    # The Engine settings table as it was (issue 30: cut off after its img/s column at 1280 px).
    wide = ["| model | batch | variant | img/s | vs timm fp32 (median, min-max) | warm-up (s) |", "|---|---:|---|---:|---:|---:|",
            "| resnext101_32x4d | 1 | onnxruntime fp32 graph_optimization_level=ORT_ENABLE_EXTENDED | 8.30 | "
            "0.89x (0.88-0.95) | 1.2 |"]
    assert min_table_width(wide) > TEXT_COLUMN_PX
    assert min_table_width(["| a | b |", "|---|---|", "| 1.00x | `a_very_long_identifier_that_may_break_anywhere` |"]) \
        == 2 * MIN_COLUMN_PX


def test_every_generated_table_fits_the_text_column_by_budget() -> None:
    too_wide = []
    for page in sorted((REPO / "docs").glob("*.md")):
        markdown = hooks.on_page_markdown(page.read_text(encoding="utf-8"), page=None, config=None, files=None)
        for lines in _markdown_tables(markdown):
            if min_table_width(lines) > TEXT_COLUMN_PX:
                too_wide.append(f"{page.name}: {lines[0]} ({min_table_width(lines):.0f} px)")
    assert not too_wide


#: Appended to a page: after load, each article table's width, its text column's, and the ratio
#: cells (``1.23x``, ``1.10-1.31``) whose text takes more than one line.
MEASURE_JS = """
window.addEventListener('load', () => setTimeout(() => {
  const lines = (el) => { const r = document.createRange(); r.selectNodeContents(el);
    return new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top))).size; };
  const tables = [...document.querySelectorAll('article table')].map((t) => ({
    header: [...t.querySelectorAll('th')].map(th => th.textContent.trim()).join(' | '),
    width: t.scrollWidth, column: t.closest('article').clientWidth,
    wrapped: [...t.querySelectorAll('td')].filter(td => /^[0-9.]+x?$|^[0-9.]+-[0-9.]+$/.test(td.textContent.trim())
      && lines(td) > 1).map(td => td.textContent.trim())}));
  const out = document.createElement('pre'); out.id = 'table-widths';
  out.textContent = JSON.stringify({window: window.innerWidth, tables});
  document.body.appendChild(out);
}, 200));
"""


@pytest.mark.slow
def test_no_table_is_wider_than_the_text_column_in_a_browser(site: Path, tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no Chromium on PATH to measure the tables with (apt-get install chromium)")
    problems, measured = [], 0
    for page in sorted(site.rglob("index.html")):
        text = page.read_text(encoding="utf-8")
        if "<table" not in text:
            continue
        probe = page.with_name("table-widths-probe.html")  # beside the page: its relative links work
        probe.write_text(text.replace("</body>", f"<script>{MEASURE_JS}</script></body>"), encoding="utf-8")
        done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                               f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000",
                               "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
        probe.unlink()
        found = re.search(r'<pre id="table-widths">(.*?)</pre>', done.stdout, re.S)
        assert found, f"{page}: no measurement ({done.stderr[-500:]})"
        data = json.loads(html.unescape(found.group(1)))
        assert data["window"] == 1280
        for t in data["tables"]:
            measured += 1
            if t["width"] > t["column"] or t["wrapped"]:
                problems.append(f"{page.parent.relative_to(site)}: {t['header'][:60]}: {t['width']} px in "
                                f"{t['column']} px; wrapped {t['wrapped'][:3]}")
    assert measured > 50 and not problems

