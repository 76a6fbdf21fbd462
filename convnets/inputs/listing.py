"""The inputs of a batch job: files, directories (their images, lazily) and URLs, as ``(input, error)`` items,
and the command line's INPUTs and ``--from-file`` list (:func:`read_sources`). Memory stays constant for any
number of inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

from convnets.constants import IMAGE_SUFFIXES
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.paths import file_kind
from convnets.preprocessing.sources import is_url  # not .io: the command line checks inputs with this module before requests and Pillow

__all__ = ["InputItem", "expand_inputs", "iter_chunks", "iter_inputs", "read_list", "read_sources"]

log = logging.getLogger(__name__)


#: One input after expansion, with its error when it is known to fail.
InputItem = tuple[str, "ImageLoadError | None"]


def _hidden(name: str) -> bool:  # also macOS's ._name resource forks
    return name.startswith(".")


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES and not _hidden(name)


def _walk(directory: str, recursive: bool, ancestors: frozenset[str] = frozenset()) -> Iterator[str]:
    """Images in ``directory`` and, ``recursive``, its subfolders', sorted by path; hidden ones and cycles skipped."""
    try:
        with os.scandir(directory) as listing:
            entries = sorted((e for e in listing if not _hidden(e.name)), key=lambda e: e.name)
    except OSError as e:
        log.warning("cannot list %s: %s", directory, e)
        return
    inside = ancestors | {os.path.realpath(directory)} if recursive else ancestors
    for entry in entries:
        path = str(Path(directory) / entry.name)  # as Path spells it: './a' lists 'a/x.jpg'
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir:
            if recursive and os.path.realpath(path) not in inside:
                yield from _walk(path, recursive, inside)
        elif _is_image(entry.name) and entry.is_file():
            yield path


def iter_inputs(inputs: Iterable[str] | str | os.PathLike[str], *, recursive: bool = False) -> Iterator[InputItem]:
    """Replace each directory of ``inputs`` (paths and URLs, or one alone) by its images, hidden ones skipped and,
    ``recursive``, its subfolders', lazily.

    Yields:
        ``(input, None)`` per file or URL in order; ``(input, error)`` for a directory without images
        and for a FIFO, socket or device (never opened: a FIFO would block).
    """
    paths: Iterable[str | os.PathLike[str]] = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    for path in paths:
        item = os.fspath(path)
        if is_url(item):
            yield item, None
            continue
        if not os.path.isdir(item):
            yield item, _not_a_file(item)
            continue
        found = False
        for image in _walk(item, recursive):
            found = True
            yield image, None
        if not found:
            where = "or its subfolders " if recursive else ""
            yield item, ImageLoadError(f"Cannot load images from {item!r}: the directory {where}has no files "
                                       f"ending in {', '.join(sorted(IMAGE_SUFFIXES))}.")


def _not_a_file(item: str) -> ImageLoadError | None:
    """Why ``item`` (not a directory) is refused unopened, or ``None`` (a missing file is the decoder's to say)."""
    if "\0" in item:
        return ImageLoadError(f"Cannot load image {item!r}: a path cannot contain a NUL byte.")
    try:
        mode = os.stat(item).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return ImageLoadError(f"Cannot load image {item!r}: it is {file_kind(mode)}, not a regular file; give image "
                          "files.")


def expand_inputs(inputs: Iterable[str], *, recursive: bool = False) -> list[InputItem]:
    """:func:`iter_inputs` as a list (for few inputs; streams should use :func:`iter_inputs`)."""
    return list(iter_inputs(inputs, recursive=recursive))


def read_list(stream: TextIO, name: str = "-") -> Iterator[str]:
    """Inputs listed one per line in ``stream`` (decoded with ``surrogateescape``), skipping blanks and ``#``
    comments; a read error names ``name`` and the line."""
    number = 0
    try:
        for number, line in enumerate(stream, 1):
            text = line.strip()
            if text and not text.startswith("#"):
                yield text
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidArgumentError(f"--from-file {name}, line {number + 1}: cannot read it ({why})") from e


def read_sources(inputs: Sequence[str], from_file: str | None, stack: ExitStack) -> Iterator[str]:
    """``inputs``, then the lines of the list file ``from_file`` (``"-"``: standard input; ``stack`` closes it), lazily.

    Lines are UTF-8 with ``surrogateescape``, so a name that is not UTF-8 stays the file's name.
    """
    import sys

    yield from inputs
    if from_file == "-":
        reconfigure = getattr(sys.stdin, "reconfigure", None)
        if reconfigure is not None:  # names as os.fsdecode gives them (before anything is read)
            with contextlib.suppress(ValueError, OSError):
                reconfigure(encoding="utf-8", errors="surrogateescape")
        yield from read_list(sys.stdin, "-")
    elif from_file is not None:
        try:
            # surrogateescape: a line that is not UTF-8 is the name os.fsdecode gives (bytes-safe).
            stream = stack.enter_context(open(from_file, encoding="utf-8", errors="surrogateescape"))
        except OSError as e:
            raise InvalidArgumentError(f"--from-file {from_file}: cannot read it ({e.strerror})") from e
        yield from read_list(stream, from_file)


def iter_chunks(items: Iterable[InputItem], batch_size: int, start: int = 0) -> Iterator[list[InputItem]]:
    """``items`` in batches of ``batch_size``, lazily; the first is shortened by ``start`` (inputs of the run
    before ``items``), so that each image is in the uninterrupted run's batch and gives the same numbers."""
    stream = iter(items)
    first = batch_size - start % batch_size
    while chunk := list(itertools.islice(stream, first or batch_size)):
        first = 0
        yield chunk
