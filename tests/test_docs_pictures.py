"""The package's own pictures on its pages (``docs/pictures.py``): in the strictly built site, each page
shows its pictures, each the file its record (``docs/pictures/provenance.json``) describes, made from
inputs that are still the ones recorded; the Design page's layers diagram is the import graph, computed
independently by ``tests/test_architecture.py``."""

from __future__ import annotations

import hashlib
import html
import json
import re
from pathlib import Path

import pytest
from conftest import REPO
from PIL import Image
from test_architecture import import_graph
from test_docs_build import hooks

SHEET_TILE, SHEET_GAP = 256, 8  # the contact sheet's default geometry
EXAMPLES = sorted(p for p in (REPO / "convnets" / "assets" / "examples").iterdir() if p.suffix in (".png", ".jpg"))


pictures = hooks._import("docs.pictures")  # as the site build imports it
RECORD = json.loads((REPO / "docs" / "pictures" / "provenance.json").read_text(encoding="utf-8"))


@pytest.fixture
def site(built_site: Path) -> Path:
    return built_site


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("page, name", [("inference", "sheet.png"), ("training", "curves.png"),
                                        ("evaluation", "confusion.png"), ("explain", "explain.png")])
def test_each_page_shows_its_picture_as_recorded(site: Path, page: str, name: str) -> None:
    text = (site / page / "index.html").read_text(encoding="utf-8")
    sources = re.findall(r'<img[^>]* src="([^"]+)"', text)
    assert f"../pictures/{name}" in sources, sources
    shown = (site / page / ".." / "pictures" / name).resolve()
    entry = RECORD["pictures"][name]
    assert _sha256(shown) == entry["sha256"]  # the very file the command made and recorded
    with Image.open(shown) as image:
        assert image.format == "PNG" and image.width > 300
    # The caption says what made it: the record's words, the one command, the exact convnets command.
    for words in (entry["caption"], "python docs/pictures.py", entry["command"], RECORD["date"]):
        assert html.escape(words, quote=False) in text, words


def test_the_inputs_are_the_ones_recorded(tmp_path: Path) -> None:
    """Each recorded input is still what the picture was made from: the example photos, byte for byte,
    and the generated data set, made again here."""
    sheet = RECORD["pictures"]["sheet.png"]
    assert sheet["inputs"] == {f"convnets/assets/examples/{p.name}": _sha256(p) for p in EXAMPLES}
    digest = pictures.make_dataset(tmp_path / "patterns")
    for name in ("curves.png", "confusion.png"):
        assert RECORD["pictures"][name]["inputs"] == {"generated data set (make_dataset)": digest}
    assert len(list((tmp_path / "patterns" / "val").rglob("*.png"))) == 48
    assert "48 validation images" in RECORD["pictures"]["confusion.png"]["caption"]
    # The heat maps: the quarters data set, made again here; one validation image per class explained.
    quarters = RECORD["pictures"]["explain.png"]
    assert quarters["inputs"] == {"generated data set (make_quarters)": pictures.make_quarters(tmp_path / "quarters")}
    assert all(f"quarters/val/{c}/000.png" in quarters["command"] for c in pictures.CLASSES)
    with Image.open(REPO / "docs" / "pictures" / "explain.png") as image:
        assert image.size == (8 + len(pictures.CLASSES) * (192 + 8), 2 * 192 + 3 * 8)
    # The sheet holds one tile per example, in one row.
    with Image.open(REPO / "docs" / "pictures" / "sheet.png") as image:
        assert image.width == SHEET_GAP + len(EXAMPLES) * (SHEET_TILE + SHEET_GAP)
    # Honest about the weights: NVIDIA's, or the patterns model with a caption that says its classes.
    if "NVIDIA's ImageNet weights" not in sheet["weights"]:
        assert "--weights run/model_best.pth.tar" in sheet["command"]
        assert "not ImageNet's" in sheet["caption"] and all(c in sheet["caption"] for c in pictures.CLASSES)


def _closure(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    pairs: set[tuple[str, str]] = set()
    for start in graph:
        todo, seen = list(graph[start]), set()
        while todo:
            if (b := todo.pop()) not in seen:
                seen.add(b)
                todo.extend(graph.get(b, ()))
        pairs.update((start, b) for b in seen)
    return pairs


@pytest.mark.slow
def test_the_layers_diagram_is_the_import_graph(site: Path) -> None:
    def box(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module.split(".")[0] == "convnets":
            graph.setdefault(box(module), set()).update(
                box(t) for t in targets if t.split(".")[0] == "convnets" and box(t) != box(module))
    text = (site / "design" / "index.html").read_text(encoding="utf-8")
    assert text.count("<svg") >= 1 and "<!-- layers -->" not in text
    arrows: dict[str, set[str]] = {}
    for a, b in re.findall(r'data-from="([\w.]+)" data-to="([\w.]+)"', text):
        arrows.setdefault(a, set()).add(b)
    labels = set(re.findall(r'font-family="monospace" font-size="12" fill="#1a1a1a">([\w/.]+)</text>', text))
    assert labels == {"convnets/__init__" if b == "convnets" else b for b in graph}
    assert all(b in graph[a] for a, bs in arrows.items() for b in bs)  # every arrow is a real import
    assert _closure(arrows) == _closure(graph)  # and every import is an arrow or a path of them


def test_arrows_that_a_longer_path_implies_are_left_out() -> None:
    rows, arrows = pictures.layers({"cli": {"commands", "errors"}, "commands": {"errors"}, "errors": set()})
    assert rows == [["errors"], ["commands"], ["cli"]]
    assert arrows == {"cli": {"commands"}, "commands": {"errors"}, "errors": set()}
