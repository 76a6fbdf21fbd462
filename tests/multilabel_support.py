"""A synthetic multi-label image set for the multi-label tests (and the explanation tests).

Each class is a coloured square in a region of its own (one quadrant each); an image holds any subset
of the patterns on a noisy grey background, so which labels it has is decided by those regions alone.
:func:`make_multilabel` writes the PNG files under ``root/train`` and ``root/val`` and the labels CSV
(``path``, ``labels`` separated by ``;``) that ``convnets train --multilabel`` reads, and returns where
each pattern lies.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

#: Class name -> (RGB colour, region as (left, top, right, bottom) fractions of the image).
PATTERNS: dict[str, tuple[tuple[int, int, int], tuple[float, float, float, float]]] = {
    "blue": ((30, 60, 230), (0.5, 0.5, 1.0, 1.0)),
    "green": ((40, 200, 60), (0.5, 0.0, 1.0, 0.5)),
    "red": ((230, 40, 40), (0.0, 0.0, 0.5, 0.5)),
    "yellow": ((240, 220, 30), (0.0, 0.5, 0.5, 1.0)),
}


@dataclass(frozen=True)
class MultiLabelData:
    """What :func:`make_multilabel` wrote.

    Attributes:
        root: the ``--data`` directory.
        labels: the CSV (``root/labels.csv``).
        classes: the class names, sorted (the model's order after training).
        regions: class name -> the pixel box ``(left, top, right, bottom)`` its pattern is drawn in.
        images: split -> ``(path, labels)`` of each image, in file order.
    """

    root: Path
    labels: Path
    classes: list[str]
    regions: dict[str, tuple[int, int, int, int]]
    images: dict[str, list[tuple[Path, tuple[str, ...]]]]


def _subsets(n: int, classes: list[str], rng: np.random.Generator) -> list[tuple[str, ...]]:
    """``n`` label sets: each class present with probability 1/2, every count from 0 to all represented."""
    chosen = [tuple(c for c in classes if rng.random() < 0.5) for _ in range(n)]
    for count in range(len(classes) + 1):  # at least one image with none, one, two, ... labels
        chosen[count % n] = tuple(rng.permutation(classes)[:count].tolist())
    return [tuple(sorted(s)) for s in chosen]


def make_multilabel(root: Path, n_train: int = 64, n_val: int = 32, size: int = 32, seed: int = 0) -> MultiLabelData:
    """Write the images and ``root/labels.csv``; see the module docstring.

    Args:
        root: the directory (created).
        n_train, n_val: images per split.
        size: image side in pixels.
        seed: of the label sets and the background noise.
    """
    rng = np.random.default_rng(seed)
    classes = sorted(PATTERNS)
    margin = size // 8  # the square fills its region but for a margin: center crops keep it
    regions = {c: (int(l * size) + margin, int(t * size) + margin, int(r * size) - margin, int(b * size) - margin)
               for c, (_, (l, t, r, b)) in PATTERNS.items()}
    images: dict[str, list[tuple[Path, tuple[str, ...]]]] = {}
    rows = []
    for split, n in (("train", n_train), ("val", n_val)):
        folder = root / split
        folder.mkdir(parents=True, exist_ok=True)
        images[split] = []
        for i, labels in enumerate(_subsets(n, classes, rng)):
            pixels = rng.normal(128, 20, (size, size, 3)).clip(0, 255)
            for c in labels:
                left, top, right, bottom = regions[c]
                pixels[top:bottom, left:right] = PATTERNS[c][0]
            path = folder / f"{i:03d}.png"
            Image.fromarray(pixels.astype(np.uint8)).save(path)
            images[split].append((path, labels))
            rows.append((f"{split}/{path.name}", ";".join(labels)))
    csv_path = root / "labels.csv"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(("path", "labels"))
        writer.writerows(rows)
    return MultiLabelData(root, csv_path, classes, regions, images)
