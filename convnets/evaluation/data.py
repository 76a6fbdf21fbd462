"""The images and true classes of an evaluation data set, in every layout ``convnets evaluate`` reads.

:func:`find_eval_samples` detects the layout of ``--data DIR`` and returns ``(path, class index)``
pairs in the *model's* class order (:class:`EvalSamples`):

* ``folders``: ``DIR/<class>/*`` (also ``DIR/val/<class>/*``, the ``convnets train`` layout).
  Folder names are matched to the model's ``class_names`` when it has them, to the bundled
  ImageNet WordNet ids (``n01440764``, ...) for a 1000-class model; a model without class names
  and as many outputs as there are folders takes them in sorted order (as ``train`` does).
* ``kaggle``: flat images with Kaggle's ``LOC_val_solution.csv`` (``ImageId,PredictionString``;
  the first word of ``PredictionString`` is the image's WordNet id), searched in ``DIR`` and up to
  four folders above it (the Kaggle download keeps it four levels above
  ``ILSVRC/Data/CLS-LOC/val/``; ``DIR`` may also be that download's top folder).
* ``devkit``: flat ``ILSVRC2012_val_NNNNNNNN.JPEG`` images with the ILSVRC2012 devkit: its archive
  ``ILSVRC2012_devkit_t12.tar.gz`` or torchvision's ``meta.bin`` (both read by torchvision's own
  ImageNet parser), or the extracted ``ILSVRC2012_devkit_t12/data/`` (the ground-truth file lists
  devkit labels 1..1000 in the devkit's ILSVRC2012_ID order, which ``meta.mat`` maps to WordNet
  ids; read with scipy as torchvision reads it). Image ``N`` is line ``N`` of the ground truth, so a
  partial copy of the 50 000 images is labelled right too.

* ``multilabel``: for a multi-label model, the labels CSV of ``convnets train --multilabel``
  (:mod:`convnets.data.multilabel`; ``--labels FILE.csv``, paths relative to ``DIR``): its ``val``
  rows when it has any, else all its rows (:func:`multilabel_samples`), targets multi-hot in the
  model's class order.

WordNet ids are mapped to the model's class order through the bundled 1000-class table
(:mod:`convnets.preprocessing.classes`) or the model's own class names. ``labels=`` (``--labels
FILE``) names the labels file instead of searching. When nothing matches, :class:`DataError`
says what was looked for, naming ``--data`` (``data=`` in Python).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from convnets.constants import IMAGE_SUFFIXES
from convnets.data.batches import Target
from convnets.errors import DataError, InvalidArgumentError, MissingDependencyError, short_repr
from convnets.extras import install_hint
from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_synsets

__all__ = ["DEVKIT_ARCHIVE", "GROUND_TRUTH", "KAGGLE_SOLUTION", "LAYOUTS", "EvalSamples", "find_eval_samples",
           "multilabel_samples"]

log = logging.getLogger(__name__)

#: The layouts :func:`find_eval_samples` recognises.
LAYOUTS = ("folders", "kaggle", "devkit", "multilabel")
#: Kaggle's validation labels (ImageNet Object Localization Challenge).
KAGGLE_SOLUTION = "LOC_val_solution.csv"
#: The ILSVRC2012 devkit archive (what torchvision.datasets.ImageNet reads).
DEVKIT_ARCHIVE = "ILSVRC2012_devkit_t12.tar.gz"
#: The devkit's validation ground truth (``data/`` of the extracted devkit, beside ``meta.mat``).
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
_TORCHVISION_META = "meta.bin"  # torchvision.datasets.imagenet.META_FILE: the parsed devkit
_KAGGLE_VAL = Path("ILSVRC", "Data", "CLS-LOC", "val")
_LEVELS_UP = 4
_VAL_NUMBER = re.compile(r"ILSVRC2012_val_(\d+)$")


@dataclass(frozen=True)
class EvalSamples:
    """An evaluation set, labelled in the model's class order.

    Attributes:
        layout: one of :data:`LAYOUTS`.
        images: the directory the images were found in.
        samples: ``(path, class index of the model)`` pairs, sorted by path (``multilabel``: ``(path,
            multi-hot target)`` in the CSV's order).
        labels_file: the labels file of a flat layout.
        skipped: images of the directory that have no label (flat layouts), left out.
    """

    layout: str
    images: Path
    samples: Sequence[tuple[str, Target]]
    labels_file: Path | None = None
    skipped: int = 0
    split: str | None = None


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")


def _flat_images(directory: Path) -> list[Path]:
    with os.scandir(directory) as entries:
        return sorted(Path(e.path) for e in entries if e.is_file() and _is_image(Path(e.name)))


def _class_folders(directory: Path) -> list[str]:
    with os.scandir(directory) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def _class_index(keys: Sequence[str], class_names: Sequence[str] | None, num_classes: int,
                 what: str) -> dict[str, int] | None:
    """``key -> model output`` for the class keys (folder names or WordNet ids) of a data set:
    through the model's class names, else the bundled ImageNet ids for 1000 outputs; ``None`` when
    neither names every key."""
    tables = []
    if class_names is not None:
        tables.append(list(class_names))
    if num_classes == NUM_CLASSES:
        tables.append([str(s) for s in get_imgnet_synsets()])
    for table in tables:
        index = {name: i for i, name in enumerate(table)}
        if all(k in index for k in keys):
            return {k: index[k] for k in keys}
    missing = [k for k in keys if not any(k in t for t in tables)]
    log.debug("%s: %d keys not among the model's classes, e.g. %s", what, len(missing), missing[:3])
    return None


def _ancestors(directory: Path) -> Iterator[Path]:
    yield directory
    yield from list(directory.resolve().parents)[:_LEVELS_UP]


def _find_labels(directories: Sequence[Path]) -> Path | None:
    """The nearest labels file of a flat layout in or above ``directories``."""
    seen: set[Path] = set()
    for start in directories:
        for folder in _ancestors(start):
            if folder in seen:
                continue
            seen.add(folder)
            for candidate in (folder / KAGGLE_SOLUTION, folder / _TORCHVISION_META, folder / DEVKIT_ARCHIVE,
                              folder / "ILSVRC2012_devkit_t12" / "data" / GROUND_TRUTH,
                              folder / "data" / GROUND_TRUTH, folder / GROUND_TRUTH):
                if candidate.is_file():
                    return candidate
    return None


def _read_kaggle(path: Path) -> dict[str, str]:
    """``ImageId -> WordNet id`` of ``LOC_val_solution.csv``.

    Raises:
        DataError: the file is not that CSV (wrong header, an empty entry, a field over the csv
            module's limit of 128 KiB, not UTF-8 text).
    """
    # utf-8-sig: spreadsheet programs save UTF-8 CSV files with a byte-order mark first.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        try:
            if not {"ImageId", "PredictionString"} <= set(reader.fieldnames or ()):
                raise DataError(f"{path} is not Kaggle's {KAGGLE_SOLUTION}: its header is "
                                f"{short_repr(reader.fieldnames)}, expected ImageId,PredictionString")
            labels = {}
            for number, row in enumerate(reader, 2):
                words = (row["PredictionString"] or "").split()
                if not row["ImageId"] or not words:
                    raise DataError(f"{path}, line {number}: no ImageId or no class in PredictionString")
                labels[row["ImageId"]] = words[0]
        except (csv.Error, UnicodeDecodeError) as e:  # e.g. "field larger than field limit (131072)"
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise DataError(f"{path}, near line {reader.line_num + 1}: not Kaggle's {KAGGLE_SOLUTION} ({reason})") from e
    return labels


def _parse_meta_mat(devkit_data: Path) -> dict[int, str]:
    """``ILSVRC2012_ID -> WordNet id`` of the 1000 leaf synsets of ``meta.mat``.

    torchvision parses the devkit *archive* only (its ``parse_meta_mat`` is internal); this reads
    an extracted devkit the same way: the synsets without children, ids and WordNet ids.
    """
    try:
        import scipy.io
    except ImportError as e:
        raise MissingDependencyError(f"scipy is needed to read the devkit's meta.mat ({e}); install the "
                                     f"'imagenet' extra: {install_hint('imagenet')}") from e
    path = devkit_data / "meta.mat"
    if not path.is_file():
        raise DataError(f"{devkit_data / GROUND_TRUTH} needs the devkit's meta.mat beside it (it maps the devkit's "
                        "labels 1..1000 to WordNet ids); keep the devkit's data/ folder whole")
    synsets = scipy.io.loadmat(str(path), squeeze_me=True)["synsets"]
    return {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}


def _devkit_wnids(labels: Path) -> list[str]:
    """The WordNet id of validation image ``N`` at index ``N - 1``, from any form of the devkit."""
    if labels.name == GROUND_TRUTH or labels.suffix == ".txt":
        idx_to_wnid = _parse_meta_mat(labels.parent)
        lines = [line.strip() for line in labels.read_text().splitlines() if line.strip()]
        try:
            return [idx_to_wnid[int(line)] for line in lines]
        except (KeyError, ValueError) as e:
            raise DataError(f"{labels}: {e} is not a devkit label of {labels.parent / 'meta.mat'}") from e
    from torchvision.datasets import imagenet

    try:
        wnids: object
        if labels.name.endswith((".tar.gz", ".tgz", ".tar")):
            # torchvision writes its meta.bin beside the archive: parse in a folder of our own, so
            # the user's data directory is left as it was.
            with tempfile.TemporaryDirectory() as tmp:
                link = Path(tmp) / labels.name
                with contextlib.suppress(OSError):
                    link.symlink_to(labels.resolve())
                if not link.exists():
                    shutil.copy(labels, link)
                imagenet.parse_devkit_archive(tmp, labels.name)
                wnids = imagenet.load_meta_file(tmp)[1]
        else:
            wnids = imagenet.load_meta_file(str(labels.parent), labels.name)[1]
    except ImportError as e:
        raise MissingDependencyError(f"scipy is needed to parse the devkit ({e}); install the 'imagenet' extra: "
                                     f"{install_hint('imagenet')}") from e
    except RuntimeError as e:  # torchvision: a missing or corrupted archive / meta file
        raise DataError(f"{labels}: {str(e).strip()[:300]}") from e
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- unpickling arbitrary bytes fails with any exception type
        # A file that is neither (UnpicklingError, tarfile.ReadError, a pickle of something else, ...).
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        what = "the devkit archive" if labels.name.endswith((".tar.gz", ".tgz", ".tar")) else \
            f"torchvision's ImageNet {_TORCHVISION_META}"
        raise DataError(f"{labels} is not {what} (corrupt, or another kind of file): {type(e).__name__}"
                        + (f": {reason}" if reason and not isinstance(e, pickle.UnpicklingError) else "")) from e
    if not isinstance(wnids, (list, tuple)) or not all(isinstance(w, str) for w in wnids):
        raise DataError(f"{labels} is not torchvision's ImageNet {_TORCHVISION_META}: it holds no list of WordNet "
                        "ids for the validation images")
    return list(wnids)


def _label_kind(labels: Path) -> str:
    if labels.suffix.lower() == ".csv":
        return "kaggle"
    if labels.name.endswith((".tar.gz", ".tgz", ".tar", ".bin", ".txt")):
        return "devkit"
    kinds = (f"Kaggle's {KAGGLE_SOLUTION}, the devkit's {DEVKIT_ARCHIVE}, its data/{GROUND_TRUTH} (with meta.mat "
             f"beside it) or torchvision's {_TORCHVISION_META}")
    raise InvalidArgumentError(f"labels={str(labels)!r} is not a labels file of a known kind; give {kinds}",
                               cli=f"--labels {labels} is not a labels file of a known kind; give {kinds}",
                               keyword="labels")


def _flat_samples(images: Path, files: list[Path], labels: Path, class_names: Sequence[str] | None,
                  num_classes: int) -> EvalSamples:
    kind = _label_kind(labels)
    if kind == "kaggle":
        by_id = _read_kaggle(labels)
        wnid_of = {f: by_id.get(f.stem) for f in files}
    else:
        wnids = _devkit_wnids(labels)
        wnid_of = {}
        for f in files:
            m = _VAL_NUMBER.match(f.stem)
            number = int(m.group(1)) if m else 0
            wnid_of[f] = wnids[number - 1] if 1 <= number <= len(wnids) else None
    labelled = {f: w for f, w in wnid_of.items() if w is not None}
    skipped = len(files) - len(labelled)
    if not labelled:
        raise DataError(f"none of the {len(files)} images in {images} has a label in {labels} (image names such as "
                        f"{files[0].name} must match its entries)")
    if skipped:
        log.warning("%d of %d images in %s have no label in %s and are left out", skipped, len(files), images, labels)
    index = _class_index(sorted(set(labelled.values())), class_names, num_classes, str(labels))
    if index is None:
        raise DataError(f"the classes of {labels} (WordNet ids such as {next(iter(labelled.values()))}) are not the "
                        f"model's: it has {num_classes} outputs"
                        + (f" named e.g. {list(class_names[:3])}" if class_names else " and no class names"))
    samples = sorted((str(f), index[w]) for f, w in labelled.items())
    return EvalSamples(kind, images, samples, labels_file=labels, skipped=skipped)


def _folder_samples(directory: Path, class_names: Sequence[str] | None, num_classes: int) -> EvalSamples:
    from convnets.data.scan import class_samples

    folders = _class_folders(directory)
    index = _class_index(folders, class_names, num_classes, str(directory))
    if index is None:
        if class_names is None and len(folders) == num_classes:
            log.info("%s: class folders taken in sorted order as the model's %d outputs", directory, num_classes)
            index = {name: i for i, name in enumerate(folders)}
        else:
            names = f"class names (e.g. {list(class_names[:3])})" if class_names else "no class names"
            raise DataError(f"the {len(folders)} class folders of {directory} (e.g. {folders[:3]}) are not the model's "
                            f"classes: it has {num_classes} outputs and {names}"
                            + ("; a 1000-class ImageNet model reads WordNet-id folders (n01440764, ...)"
                               if num_classes == NUM_CLASSES else ""))
    samples = class_samples(directory, index, tuple(IMAGE_SUFFIXES))
    if not samples:
        raise DataError(f"the class folders of {directory} hold no images")
    return EvalSamples("folders", directory, sorted(samples))


def multilabel_samples(data: str | os.PathLike[str], labels: str | os.PathLike[str] | None,
                       class_names: Sequence[str]) -> EvalSamples:
    """The images of a multi-label labels CSV and their multi-hot targets over ``class_names`` (a
    multi-label model's): the rows of its ``val`` split when it has one, else every row.

    Raises:
        DataError: no ``labels`` given, not such a CSV (see :func:`~convnets.data.multilabel.read_labels_csv`),
            or a label that is not one of ``class_names``.
    """
    from convnets.data.multilabel import multi_hot, read_labels_csv

    if labels is None:
        raise DataError("a multi-label model is evaluated on the images of a labels CSV (path, labels, optional "
                        "split); pass labels=", cli="a multi-label model is evaluated on the images of a labels CSV "
                        "(path, labels, optional split); pass --labels FILE.csv", keyword="labels")
    if not Path(data).is_dir():
        raise DataError(f"data={str(data)!r} is not a directory", cli=f"--data {data} is not a directory", keyword="data")
    rows = read_labels_csv(data, labels)
    split = "val" if any(row.split == "val" for row in rows) else None
    chosen = [row for row in rows if split is None or row.split == split]
    index = {name: i for i, name in enumerate(class_names)}
    unknown = sorted({name for row in chosen for name in row.labels if name not in index})
    if unknown:
        raise DataError(f"--labels {labels} has labels the model does not know: {', '.join(unknown[:5])}"
                        f"{', ...' if len(unknown) > 5 else ''} (its classes: {', '.join(list(class_names)[:5])}"
                        f"{', ...' if len(class_names) > 5 else ''})")
    return EvalSamples("multilabel", Path(data), [(row.path, multi_hot(row.labels, index)) for row in chosen],
                       labels_file=Path(labels), skipped=len(rows) - len(chosen), split=split)


def find_eval_samples(data: str | os.PathLike[str], *, class_names: Sequence[str] | None, num_classes: int,
                      labels: str | os.PathLike[str] | None = None) -> EvalSamples:
    """The labelled images of ``data`` in any layout of the module docstring.

    Args:
        data: the data directory (``--data``).
        class_names: the model's class names, or ``None``.
        num_classes: the model's number of outputs.
        labels: the labels file of a flat layout (``--labels``); ``None``: searched for.

    Returns:
        The samples, labelled with the model's class indices.

    Raises:
        DataError: no layout matches, or its classes are not the model's.
        InvalidArgumentError: ``labels`` is not a labels file of a known kind.
        MissingDependencyError: a devkit without scipy installed.
    """
    data = Path(data)
    if not data.is_dir():
        raise DataError(f"data={str(data)!r} is not a directory", cli=f"--data {data} is not a directory", keyword="data")
    if labels is not None and not Path(labels).is_file():
        raise DataError(f"labels={str(labels)!r} is not a file", cli=f"--labels {labels} is not a file",
                        keyword="labels")
    # Where the images are: DIR itself, a Kaggle download's top folder, or a train/val layout.
    images = data
    if not _flat_images(data):
        for inner in (data / _KAGGLE_VAL, data / "val"):
            if inner.is_dir():
                images = inner
                break
    files = _flat_images(images)
    if files:
        found = Path(labels) if labels is not None else _find_labels([images, data])
        if found is not None:
            return _flat_samples(images, files, found, class_names, num_classes)
    if _class_folders(images):
        if labels is not None:
            log.warning("--labels %s is not used: %s holds class folders", labels, images)
        return _folder_samples(images, class_names, num_classes)
    what = f"{len(files)} images but no labels file" if files else "no images and no class folders"

    def message(data_opt: str, labels_opt: str) -> str:
        return (f"{data_opt}{data} has {what}. It must be a class tree DIR/<class>/*, or flat ImageNet validation "
                f"images with Kaggle's {KAGGLE_SOLUTION} or the devkit ({DEVKIT_ARCHIVE}, or its data/{GROUND_TRUTH} "
                f"with meta.mat) in DIR or up to {_LEVELS_UP} folders above it; name a labels file elsewhere with "
                f"{labels_opt}")
    raise DataError(message("data=", "labels=FILE"), cli=message("--data ", "--labels FILE"), keyword="data")
