"""Multi-label data: the labels CSV of ``convnets train --multilabel`` and ``convnets evaluate --labels``.

The CSV (UTF-8, a header line) has the columns ``path`` and ``labels`` and optionally ``split``:

* ``path``: the image, relative to ``--data DIR`` (or, when it is not there, to the CSV's folder; or
  absolute);
* ``labels``: its labels separated by ``;`` (spaces around them ignored; empty: an image with none of
  the labels);
* ``split``: ``train`` or ``val``; without this column the first folder of ``path`` is the split
  (``train/...``, ``val/...``: the folder layout of single-label training). Rows of any other split
  are not used for training.

The classes are the sorted set of every label in the file. A sample's target is its multi-hot
vector: 1.0 for each of its labels, in class order.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from convnets.errors import DataError, short_repr

__all__ = ["LABEL_SEPARATOR", "SPLITS", "LabelledImage", "MultiLabelSet", "read_labels_csv", "multilabel_set"]

log = logging.getLogger(__name__)

#: What separates the labels of an image in the ``labels`` column.
LABEL_SEPARATOR = ";"
#: The splits training reads.
SPLITS = ("train", "val")

#: A sample: the image's path and its multi-hot target.
Sample = tuple[str, tuple[float, ...]]


@dataclass(frozen=True)
class LabelledImage:
    """One row of the labels CSV: the image's full path, its split (``None``: none given) and labels."""

    path: str
    split: str | None
    labels: tuple[str, ...]


def read_labels_csv(data: str | os.PathLike[str], labels: str | os.PathLike[str],
                    option: str = "--labels") -> list[LabelledImage]:
    """The rows of the labels CSV ``labels``, their paths joined to ``data``.

    Raises:
        DataError: not such a CSV (no ``path`` / ``labels`` column, not UTF-8, an empty path), a path that is
            not a file, or no rows.
    """
    data, labels = Path(data), Path(labels)
    rows: list[LabelledImage] = []
    try:
        with open(labels, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            fields = [name.strip() for name in reader.fieldnames or ()]
            if not {"path", "labels"} <= set(fields):
                raise DataError(f"{option} {labels}: its header is {short_repr(reader.fieldnames)}; a multi-label CSV "
                                "has the columns path and labels (labels separated by ';'), and optionally split")
            reader.fieldnames = fields
            has_split = "split" in fields
            for number, row in enumerate(reader, 2):
                name = (row.get("path") or "").strip()
                if not name:
                    raise DataError(f"{option} {labels}, line {number}: no path")
                names = tuple(dict.fromkeys(n.strip() for n in (row.get("labels") or "").split(LABEL_SEPARATOR)
                                            if n.strip()))
                if has_split:
                    split = (row.get("split") or "").strip() or None
                else:
                    parts = PurePosixPath(name.replace(os.sep, "/")).parts
                    split = parts[0] if len(parts) > 1 and parts[0] in SPLITS else None
                path = data / name
                if not path.is_file() and (labels.parent / name).is_file():
                    path = labels.parent / name  # a CSV beside its images, --data elsewhere
                if not path.is_file():
                    raise DataError(f"{option} {labels}, line {number}: {path} is not a file (paths are relative to "
                                    "--data)")
                rows.append(LabelledImage(str(path), split, names))
    except (csv.Error, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataError(f"{option} {labels}: not a multi-label CSV ({reason})") from e
    except OSError as e:
        raise DataError(f"{option} {labels}: cannot be read ({e.strerror or e})") from e
    if not rows:
        raise DataError(f"{option} {labels} lists no images")
    return rows


def multi_hot(names: Sequence[str], index: dict[str, int]) -> tuple[float, ...]:
    """The multi-hot target of an image with labels ``names`` over the classes of ``index``."""
    target = [0.0] * len(index)
    for name in names:
        target[index[name]] = 1.0
    return tuple(target)


@dataclass(frozen=True)
class MultiLabelSet:
    """A multi-label training set: the classes (sorted) and the samples of each split."""

    classes: list[str]
    train: list[Sample]
    val: list[Sample]


def multilabel_set(data: str | os.PathLike[str], labels: str | os.PathLike[str]) -> MultiLabelSet:
    """The classes and the ``train`` / ``val`` samples of a labels CSV (see the module docstring).

    Raises:
        DataError: see :func:`read_labels_csv`; also no label at all, or a split without images.
    """
    rows = read_labels_csv(data, labels)
    classes = sorted({name for row in rows for name in row.labels})
    if not classes:
        raise DataError(f"--labels {labels} gives no image any label")
    index = {name: i for i, name in enumerate(classes)}
    splits: dict[str | None, list[Sample]] = {}
    for row in rows:
        splits.setdefault(row.split, []).append((row.path, multi_hot(row.labels, index)))
    other = sum(len(v) for k, v in splits.items() if k not in SPLITS)
    if other:
        log.info("%s: %d rows of neither split (train, val) are not used for training", labels, other)
    for split in SPLITS:
        if not splits.get(split):
            raise DataError(f"--labels {labels} has no {split} images: give a split column (train / val), or paths "
                            "under train/ and val/ of --data")
    return MultiLabelSet(classes, splits["train"], splits["val"])
