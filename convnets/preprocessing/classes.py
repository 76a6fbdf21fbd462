"""The 1000 ImageNet-1k class names and WordNet synset ids, from the TSV bundled in the package.

Upstream downloaded ``LOC_synset_mapping.json`` into the current directory at run time; these
functions only read package data, so they work offline and never write anything.
"""

from __future__ import annotations

import csv
import functools
import io
from importlib import resources
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["NUM_CLASSES", "class_labels", "get_imgnet_classes", "get_imgnet_synsets"]

NUM_CLASSES = 1000
_TSV = "imagenet_classes.tsv"


@functools.lru_cache(maxsize=1)
def _table() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(synsets, names) in label order, read once; tuples so the cache cannot be modified."""
    text = resources.files(__package__).joinpath(_TSV).read_text(encoding="utf-8")
    rows = list(csv.DictReader(io.StringIO(text), delimiter="\t"))
    # A damaged install must fail here rather than label predictions wrongly.
    if [row.get("index") for row in rows] != [str(i) for i in range(NUM_CLASSES)]:
        raise RuntimeError(
            f"{_TSV} in the convnets.preprocessing package is damaged: expected rows 0..{NUM_CLASSES - 1} "
            f"in order. Reinstall convnets.")
    return tuple(row["synset"] for row in rows), tuple(row["names"] for row in rows)


def get_imgnet_classes() -> npt.NDArray[Any]:
    """The ImageNet-1k class names in label order, e.g. ``"tench, Tinca tinca"`` at index 0.

    Returns:
        A new numpy array of 1000 strings (callers may modify it freely).

    Raises:
        RuntimeError: the bundled class table is damaged.
    """
    return np.array(_table()[1])


def get_imgnet_synsets() -> npt.NDArray[Any]:
    """The WordNet synset ids of the ImageNet-1k classes in label order, e.g. ``"n01440764"``.

    Returns:
        A new numpy array of 1000 strings.

    Raises:
        RuntimeError: the bundled class table is damaged.
    """
    return np.array(_table()[0])


class _Classifier(Protocol):
    class_names: list[str] | None
    num_classes: int


def class_labels(model: _Classifier) -> list[str]:
    """Names of a model's outputs, for every command that shows classes (predict, explain, serve): the
    checkpoint's, ImageNet's for 1000 classes, else indices."""
    if model.class_names is not None:
        return list(model.class_names)
    if model.num_classes == NUM_CLASSES:
        return [str(name) for name in get_imgnet_classes()]
    return [f"class {i}" for i in range(model.num_classes)]
