"""Class folders scanned into ``(path, class index)`` samples, in torchvision's ImageFolder order, each real
directory once however symbolic links point (:func:`class_samples`, :func:`scan_split`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from torchvision import datasets

from convnets.errors import DataError

__all__ = ["class_samples", "scan_split"]

log = logging.getLogger(__name__)


def _folders_once(top: str) -> Iterator[tuple[str, list[str]]]:
    """``(folder, file names)`` of ``top`` and every folder below it, following symbolic links but
    entering each real directory (device and inode) once: a link back to a folder above it, or a
    second link to one already seen, is skipped with a warning (``os.walk(followlinks=True)`` would
    walk a folder holding two links to itself 2**40 times)."""
    def identity(path: str) -> tuple[int, int] | None:
        try:
            info = os.stat(path)
        except OSError:
            return None
        return info.st_dev, info.st_ino

    # ``top`` and every folder above it: a link back to one of them (to the split's folder, say) would
    # scan the other classes' folders as this class's.
    seen = {identity(top), *(identity(str(up)) for up in Path(os.path.realpath(top)).parents)}
    for folder, subfolders, files in os.walk(top, followlinks=True):
        keep = []
        for name in subfolders:
            path = os.path.join(folder, name)
            real = identity(path)
            if real is not None and real in seen:
                log.warning("not scanning %s again: it leads to %s, which is already scanned (a symbolic-link loop "
                            "or a second link to it)", path, os.path.realpath(path))
                continue
            seen.add(real)
            keep.append(name)
        subfolders[:] = keep  # os.walk enters only these
        yield folder, files


def class_samples(directory: str | os.PathLike[str], class_to_idx: Mapping[str, int],
                  extensions: tuple[str, ...]) -> list[tuple[str, int]]:
    """``(path, class index)`` of the files under each class folder of ``directory``, in torchvision's
    ``make_dataset`` order (classes, then folders, then files sorted), each real directory once.

    Args:
        directory: holds one folder per class (followed if they are symbolic links).
        class_to_idx: class folder name -> class index; missing folders are skipped.
        extensions: the file endings that count (lower case; matched case-insensitively).

    Returns:
        The samples; a class without files has none (the caller decides whether that is an error).
    """
    samples: list[tuple[str, int]] = []
    for name in sorted(class_to_idx):
        top = os.path.join(directory, name)
        if not os.path.isdir(top):
            continue
        for folder, files in sorted(_folders_once(top)):
            samples.extend((os.path.join(folder, file), class_to_idx[name]) for file in sorted(files)
                           if file.lower().endswith(extensions))
    return samples


def scan_split(root: Path, split: str) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes and ``(path, class index)`` samples of ``root/split`` in ImageFolder order
    (:func:`class_samples`: each real directory once).

    Raises:
        DataError: the directory is missing, has no class folders or a class folder without image files.
    """
    path = root / split
    if not path.is_dir():
        raise DataError(f"{path} is not a directory; --data must hold train/<class>/* and val/<class>/*")
    try:
        classes, class_to_idx = datasets.folder.find_classes(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{path} has no usable images: {e}") from e
    extensions = datasets.folder.IMG_EXTENSIONS
    samples = class_samples(path, class_to_idx, extensions)
    empty = sorted(set(classes) - {classes[index] for _, index in samples})
    if empty:
        raise DataError(f"{path} has no usable images: no file ending in {', '.join(extensions)} in the class "
                        f"folders {', '.join(empty[:5])}{', ...' if len(empty) > 5 else ''}")
    return classes, samples
