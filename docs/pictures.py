"""The package's own pictures on its pages: made by the package, never drawn by hand.

* ``<!-- layers -->`` (docs/design.md) becomes an SVG of convnets' layers, drawn when the site is built
  from the real import graph of its packages and top-level modules (:func:`layers_svg`): a new import
  redraws it, so it cannot drift. An arrow A -> B means A imports B; arrows implied by longer paths are
  left out (the transitive reduction), and rows go from the entry points down to the leaves.
* ``<!-- picture: NAME -->`` becomes ``docs/pictures/NAME`` with a caption saying when, on what, with
  which command and from what it was made (:func:`render_picture`), read from
  ``docs/pictures/provenance.json``.

The pictures of a run (the contact sheet, the training curves, the confusion matrix, the heat maps) take
minutes of CPU, too long for every build, so they are made by one command and committed with their record::

    python docs/pictures.py

It generates a small data set of patterns (:func:`make_dataset`), trains a small ResNet on it with
``convnets train`` (curves.png), evaluates it with ``convnets evaluate`` (confusion.png), and draws
the bundled examples with ``convnets predict --show`` (sheet.png): with NVIDIA's weights when they can
be had (cached, or ``CONVNETS_WEIGHTS_MIRROR``), else with the model it just trained, and the caption
says which. For the heat maps (explain.png) it trains a second small model on patterns that each sit in
their own quarter of the image (:func:`make_quarters`) and draws ``convnets explain``'s overlays of one
validation image per class. ``tests/test_docs_pictures.py`` checks each picture against its record and each record
against its inputs.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import html
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PICTURES = ROOT / "docs" / "pictures"
PROVENANCE = PICTURES / "provenance.json"
EXAMPLES = ROOT / "convnets" / "assets" / "examples"
COMMAND = "python docs/pictures.py"
PICTURE_MARKER = re.compile(r"<!--\s*picture:\s*([\w.-]+)\s*-->")
LAYERS_MARKER = "<!-- layers -->"

log = logging.getLogger("mkdocs.hooks.convnets.pictures")

# --- the layers diagram, from the import graph -----------------------------------------------------


def _unit(module: str) -> str:
    """The diagram's box of a module: its package under ``convnets`` (or top-level module)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "convnets" and len(parts) > 1 else parts[0]


def unit_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Box -> the boxes it imports (any import: module level, lazy, under ``TYPE_CHECKING``), read
    with :mod:`ast` from every module of ``convnets/`` (``convnets`` itself: its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / "convnets").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        package = ".".join(parts[:-1])  # what a relative import starts from
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        edges = graph.setdefault(_unit(module), set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            edges.update(_unit(name) for name in names if name.startswith("convnets.") and _exists(name, root))
        edges.discard(_unit(module))
    return graph


def _exists(name: str, root: Path) -> bool:
    """Whether dotted ``name`` is a module or package of the tree, or a name in one (``convnets.errors.X``)."""
    while name.count("."):
        path = root.joinpath(*name.split("."))
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return True
        name = name.rpartition(".")[0]
    return False


def layers(graph: Mapping[str, set[str]]) -> tuple[list[list[str]], dict[str, set[str]]]:
    """``(rows, arrows)``: the boxes by depth (row 0: the leaves, importing no other box) and the
    transitive reduction of ``graph``."""
    depth: dict[str, int] = {}

    def visit(box: str) -> int:
        if box not in depth:
            depth[box] = 1 + max((visit(b) for b in graph.get(box, ())), default=-1)
        return depth[box]
    for box in graph:
        visit(box)
    rows = [sorted(b for b in depth if depth[b] == d) for d in range(max(depth.values()) + 1)]

    def reach(box: str) -> set[str]:
        seen, todo = set(), list(graph.get(box, ()))
        while todo:
            if (b := todo.pop()) not in seen:
                seen.add(b)
                todo.extend(graph.get(b, ()))
        return seen
    arrows = {a: {b for b in bs if not any(b in reach(c) for c in bs - {b})} for a, bs in graph.items()}
    return rows, arrows


def layers_svg(graph: Mapping[str, set[str]] | None = None) -> str:
    """The diagram as an inline SVG; each arrow is a ``<line data-from=A data-to=B>``."""
    rows, arrows = layers(graph if graph is not None else unit_graph())
    width, box, height, gap_y = 960, (128, 26), 26, 46
    at: dict[str, tuple[float, float]] = {}
    for level, row in enumerate(reversed(rows)):
        for i, name in enumerate(row):
            at[name] = (width * (i + 0.5) / len(row), 10 + level * (height + gap_y))
    parts = [f'<svg class="convnets-layers" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} '
             f'{20 + len(rows) * (height + gap_y) - gap_y}" role="img" aria-label="convnets layers: each '
             'package and the packages it imports">',
             '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
             'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#7a8ca0"/></marker></defs>']
    for a in sorted(arrows):
        for b in sorted(arrows[a]):
            (x1, y1), (x2, y2) = at[a], at[b]
            parts.append(f'<line data-from="{a}" data-to="{b}" x1="{x1:.0f}" y1="{y1 + height}" x2="{x2:.0f}" '
                         f'y2="{y2}" stroke="#7a8ca0" stroke-opacity="0.6" marker-end="url(#arrow)"/>')
    for name, (x, y) in sorted(at.items()):
        label = "convnets/__init__" if name == "convnets" else name
        parts.append(f'<rect x="{x - box[0] / 2:.0f}" y="{y}" width="{box[0]}" height="{height}" rx="4" '
                     f'fill="#e8eef6" stroke="#4a6b8a"/><text x="{x:.0f}" y="{y + 17}" text-anchor="middle" '
                     f'font-family="monospace" font-size="12" fill="#1a1a1a">{html.escape(label)}</text>')
    return "\n".join(parts + ["</svg>"])


# --- pictures made by a run, shown with their record ---------------------------------------------


def render_picture(name: str, record: Mapping[str, Any] | None = None) -> str:
    """The Markdown of picture ``name``: the image, then its caption from the record."""
    record = record if record is not None else json.loads(PROVENANCE.read_text(encoding="utf-8"))
    if name not in record["pictures"]:
        raise KeyError(f"docs/pictures/provenance.json has no picture {name!r}: run {COMMAND}")
    entry, m = record["pictures"][name], record["machine"]
    return (f'![{entry["alt"]}](pictures/{name})\n\n'
            f'*{entry["caption"]} Made {record["date"]} on {m["cpu"]}, torch {m["torch"]}, by `{COMMAND}` '
            f'(`{entry["command"]}`).*\n')


def on_page_markdown(markdown: str) -> str:
    """Replace this module's markers in one page's Markdown (called from ``docs/hooks.py``)."""
    if LAYERS_MARKER in markdown:  # in a <div>: Markdown leaves a block-level element's HTML as it is
        markdown = markdown.replace(LAYERS_MARKER, f'<div class="convnets-layers">\n{layers_svg()}\n</div>')
    return PICTURE_MARKER.sub(lambda m: render_picture(m.group(1)), markdown)


CLASSES = ("checks", "dots", "horizontal stripes", "vertical stripes")


def make_dataset(root: Path, *, train: int = 32, val: int = 12, size: int = 40, seed: int = 0) -> str:
    """Write ``root/train/<class>/*.png`` and ``root/val/<class>/*.png``: a pattern of :data:`CLASSES`
    each (textures, which training's random crops and flips keep), dark on light in random colours,
    periods and phases, with noise.

    Returns:
        The digest of the data set: sha256 over each file's name and pixels (not its PNG bytes, which
        another zlib may compress differently).
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    digest = hashlib.sha256()
    for split, count in (("train", train), ("val", val)):
        for label in CLASSES:
            (root / split / label).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                period, phase = rng.uniform(5, 12), rng.uniform(0, 12, 2)
                across, down = ((x + phase[0]) // (period / 2)) % 2, ((y + phase[1]) // (period / 2)) % 2
                mask = {"checks": across != down, "horizontal stripes": down == 1, "vertical stripes": across == 1,
                        "dots": np.hypot((x + phase[0]) % period - period / 2,
                                         (y + phase[1]) % period - period / 2) < period / 3.5}[label]
                ink, paper = rng.integers(0, 110, 3), rng.integers(146, 256, 3)  # dark on light, any hue
                pixels = np.where(mask[..., None], ink, paper) + rng.normal(0, 20, (size, size, 3))
                image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
                name = f"{split}/{label}/{i:03d}.png"
                image.save(root / name)
                digest.update(name.encode() + np.asarray(image).tobytes())
    return digest.hexdigest()


def make_quarters(root: Path, *, train: int = 48, val: int = 4, size: int = 64, seed: int = 0) -> str:
    """Write ``root/{train,val}/<class>/*.png``: noise, and a patch of the class's texture (:data:`CLASSES`)
    somewhere inside the class's own quarter of the image (checks top-left, dots top-right, horizontal
    stripes bottom-left, vertical stripes bottom-right), so that a heat map can be checked by eye.

    Returns:
        The digest of the data set, as :func:`make_dataset`'s.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    half, side = size // 2, size * 5 // 16
    y, x = np.mgrid[0:side, 0:side]
    digest = hashlib.sha256()
    for split, count in (("train", train), ("val", val)):
        for k, label in enumerate(CLASSES):
            (root / split / label).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                across, down = (x // 4) % 2, (y // 4) % 2
                mask = {"checks": across != down, "horizontal stripes": down == 1, "vertical stripes": across == 1,
                        "dots": np.hypot(x % 8 - 3.5, y % 8 - 3.5) < 2.5}[label]
                pixels = rng.normal(128, 30, (size, size, 3))
                top = (k // 2) * half + rng.integers(1, half - side - 1)
                left = (k % 2) * half + rng.integers(1, half - side - 1)
                pixels[top:top + side, left:left + side] = np.where(mask[..., None], rng.integers(0, 60, 3),
                                                                     rng.integers(200, 256, 3))
                image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
                name = f"{split}/{label}/{i:03d}.png"
                image.save(root / name)
                digest.update(name.encode() + np.asarray(image).tobytes())
    return digest.hexdigest()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _convnets(*args: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``convnets ARGS`` in a subprocess of this checkout, as a user runs it, in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log.info("convnets %s", " ".join(args))
    return subprocess.run([sys.executable, "-m", "convnets", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _checked(done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(done.args[2:])} failed ({done.returncode}):\n{done.stderr[-3000:]}")


#: The small model trained on the patterns, and its run: 38 s of CPU time (2026-11-26, a shared 2-core machine).
TINY = '{"layers": [1, 1, 1, 1], "widths": [16, 32, 64, 128]}'
TRAIN = ["--model", "resnet50", "--arch-kwargs", TINY, "--image-size", "32", "--epochs", "10", "--batch-size", "32",
         "--lr", "0.05", "--label-smoothing", "0", "--workers", "0", "--device", "cpu", "--seed", "0",
         "--no-tensorboard", "--no-progress"]
#: The model of the heat maps: the same small ResNet at 64 px (its layer2 map, the one explained, is 8x8).
TRAIN_QUARTERS = ["--model", "resnet50", "--arch-kwargs", TINY, "--image-size", "64", "--epochs", "12",
                  "--batch-size", "32", "--lr", "0.05", "--label-smoothing", "0", "--workers", "0", "--device", "cpu",
                  "--seed", "0", "--no-tensorboard", "--no-progress"]
EVALUATE = ["evaluate", "--data", "patterns/val", "--weights", "run/model_best.pth.tar", "--output", "eval",
            "--workers", "0", "--device", "cpu", "--no-progress"]


def explain_picture(work: Path) -> dict[str, Any]:
    """Train the quarters model in ``work``, explain one validation image per class with ``convnets explain``
    and lay its overlays side by side in ``docs/pictures/explain.png``; returns the picture's record."""
    from PIL import Image

    digest = make_quarters(work / "quarters")
    _checked(_convnets("train", "--data", "quarters", "--output", "qrun", *TRAIN_QUARTERS, cwd=work))
    inputs = [f"quarters/val/{label}/000.png" for label in CLASSES]
    explain = ["explain", *inputs, "--weights", "qrun/model_best.pth.tar", "--output", "heat", "--device", "cpu"]
    _checked(_convnets(*explain, cwd=work))
    record = json.loads((work / "heat" / "explanations.json").read_text())
    tile, gap = 192, 8
    picture = Image.new("RGB", (gap + len(inputs) * (tile + gap), 2 * tile + 3 * gap), "white")
    for i, entry in enumerate(record["explanations"]):  # the photo above, its overlay below
        for row, image in enumerate((Image.open(work / entry["input"]), Image.open(work / "heat" / entry["overlay"]))):
            picture.paste(image.convert("RGB").resize((tile, tile), Image.Resampling.NEAREST),
                          (gap + i * (tile + gap), gap + row * (tile + gap)))
    picture.save(PICTURES / "explain.png")
    said = ", ".join(f"{e['label']} ({e['score']:.0%})" for e in record["explanations"])
    return {"alt": "Four generated images and their heat maps",
            "inputs": {"generated data set (make_quarters)": digest},
            "caption": f"Top: one validation image per class of a small ResNet trained at 64 px on textures that each "
                       f"sit in their own quarter ({', '.join(CLASSES)}: top-left, top-right, bottom-left, "
                       f"bottom-right). Bottom: convnets explain's overlay of each image's best class ({said}; "
                       f"{record['method']} at {record['layer']}).",
            "command": "convnets " + shlex.join(explain),
            "training": "convnets train --data quarters --output qrun " + " ".join(TRAIN_QUARTERS)}


def main() -> None:
    """Make sheet.png, curves.png, confusion.png and explain.png in ``docs/pictures/`` and write their record."""
    import torch

    PICTURES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="convnets-pictures-") as tmp:
        work = Path(tmp)
        data_digest = make_dataset(work / "patterns")
        # In the scratch folder, with relative paths: the figures' titles name "run", not /tmp/...
        _checked(_convnets("train", "--data", "patterns", "--output", "run", *TRAIN, cwd=work))
        _checked(_convnets(*EVALUATE, cwd=work))
        report = json.loads((work / "eval" / "report.json").read_text())
        shutil.copyfile(work / "run" / "curves.png", PICTURES / "curves.png")
        shutil.copyfile(work / "eval" / "confusion.png", PICTURES / "confusion.png")
        (PICTURES / "sheet.png").unlink(missing_ok=True)
        sheet = ["predict", "--show", str(PICTURES / "sheet.png"), "--workers", "0", str(EXAMPLES)]
        done = _convnets(*sheet, timeout=300)  # the default: NVIDIA's SE-ResNeXt101 weights, if they can be had
        if done.returncode == 0:
            weights = "NVIDIA's ImageNet weights of se_resnext101_32x4d"
            sheet_caption = "The bundled example photos, predicted with NVIDIA's SE-ResNeXt101-32x4d weights."
        else:
            log.warning("no NVIDIA weights here (%s): the sheet is drawn with the model trained on patterns",
                        done.stderr.strip().splitlines()[-1:] or done.returncode)
            (PICTURES / "sheet.png").unlink(missing_ok=True)
            sheet[1:1] = ["--weights", str(work / "run" / "model_best.pth.tar")]
            _checked(_convnets(*sheet))
            weights = "the model trained on generated patterns by this command (curves.png)"
            sheet_caption = ("The bundled example photos, predicted by the small model trained on generated patterns "
                             "(see Fine-tuning): NVIDIA's weights could not be downloaded where this picture was made, "
                             f"so its classes are the patterns ({', '.join(CLASSES)}), not ImageNet's.")
        evaluated = {"generated data set (make_dataset)": data_digest}
        made: dict[str, dict[str, Any]] = {
            "sheet.png": {
                "alt": "Contact sheet of the bundled example photos", "caption": sheet_caption,
                "command": "convnets " + " ".join(_shown(sheet, work)), "weights": weights,
                "inputs": {f"convnets/assets/examples/{p.name}": sha256(p)
                           for p in sorted(EXAMPLES.iterdir()) if p.suffix in (".png", ".jpg")}},
            "curves.png": {
                "alt": "Training curves: loss and top-1 against epoch", "inputs": evaluated,
                "caption": f"A small ResNet (resnet50 with {TINY}) trained from scratch for 10 epochs on a "
                           f"generated data set of {len(CLASSES)} patterns ({', '.join(CLASSES)}; 32 training and "
                           "12 validation images per class, 40 px, cropped to 32).",
                "command": "convnets train --data patterns --output run " + " ".join(TRAIN)},
            "confusion.png": {
                "alt": "Confusion matrix of the validation images", "inputs": evaluated,
                "caption": f"That model evaluated on the {report['images']} validation images: top-1 "
                           f"{report['top1']:.1f}%.",
                "command": "convnets " + " ".join(EVALUATE)},
            "explain.png": explain_picture(work),
        }
        for name, entry in made.items():
            entry["sha256"] = sha256(PICTURES / name)
        record = {"command": COMMAND,
                  "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                              "torch": torch.__version__},
                  "commit": _commit(), "pictures": made}
        PROVENANCE.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(sorted(made))} and {PROVENANCE.relative_to(ROOT)}")


def _shown(args: list[str], work: Path) -> list[str]:
    """``args`` with this machine's paths replaced by what they are."""
    names = {str(work / "run" / "model_best.pth.tar"): "run/model_best.pth.tar",
             str(PICTURES / "sheet.png"): "docs/pictures/sheet.png", str(EXAMPLES): "convnets/assets/examples"}
    return [names.get(a, a) for a in args]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
