"""The site's benchmark charts: drawn at build time from the results files they name, and shown.

* Every image on every page of the built site exists in the site.
* Each chart (``charts/NAME.svg``) names its results file and that file's sha256 in its metadata,
  and both match the file as it is now (a stale or hand-made chart fails); the numbers written on
  its bars are those of the file, read here from the JSON independently of ``docs/charts.py``.
* A results file that does not exist gives "Not measured yet" and no chart.
"""

from __future__ import annotations

import hashlib
import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
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


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "matplotlib"):
        require_module(module, extra="docs")
    site = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    env.pop(hooks.RESULTS_DIR_ENV, None)  # the real results, as CI and a reader see them
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    return site


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
        before, after = page[page.rindex("</table>", 0, image):image], page[image:page.index("</p>", image + 1)]
        assert "<h2" not in before and "<h3" not in before, name
        command = json.loads((RESULTS / f"{name}.json").read_bytes())["command"]
        assert command in html.unescape(re.sub(r"<[^>]+>", "", after)), name
