"""The inputs of a batch job: files, directories (their images, lazily) and URLs, as ``(input, error)`` items.

Used by :mod:`convnets.inference.predict` and :mod:`convnets.inference.embed` (which re-export
:func:`iter_inputs`) and by the batch-job driver (:mod:`convnets.inference.job`), which reads the
command line's INPUTs and ``--from-file`` list with :func:`read_sources`. Everything is lazy: a
list of millions of paths or a deep tree costs no more memory than a few inputs.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

from convnets.constants import IMAGE_SUFFIXES
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.fileio import file_kind
from convnets.preprocessing.io import is_url

__all__ = ["InputItem", "expand_inputs", "iter_inputs", "read_list", "read_sources"]

log = logging.getLogger(__name__)


#: One input after expansion: a file or URL, or an input that is already known to fail with its error.
InputItem = tuple[str, "ImageLoadError | None"]


def _hidden(name: str) -> bool:
    """Hidden files and folders (``.name``; also macOS's ``._name`` resource forks) are skipped."""
    return name.startswith(".")


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES and not _hidden(name)


def _walk(directory: str, recursive: bool, ancestors: frozenset[str] = frozenset()) -> Iterator[str]:
    """Images in ``directory``, sorted by name; with ``recursive`` its subfolders' in the same order
    (each folder's images and subfolders sorted together, so a path sorts by its components).

    Hidden files and folders are skipped; a symbolic link to a folder that is being walked (a
    cycle) is not entered.
    """
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
    """Replace each directory by its images, lazily (constant memory for any number of inputs).

    Args:
        inputs: file paths, directories and URLs, as given on the command line or read from a list
            (or one of them alone). Only directories are searched; a file named explicitly is used
            even when hidden.
        recursive: search directories' subfolders too (depth first, sorted by name); default: only
            the images directly inside. Hidden files and folders (``.name``, ``._name``) are skipped.

    Yields:
        ``(input, None)`` for each file or URL in order; a directory without images gives
        ``(directory, error)``, and so does a FIFO, socket or device (never opened: reading a FIFO
        would wait forever), so that they are reported like any other unreadable input.
    """
    # One path alone, not an iterable of its characters.
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
    """Why the path ``item`` (not a directory) is refused before anyone opens it, or ``None``.

    A FIFO, socket or device is never opened (reading a FIFO would wait for a writer forever); a
    path that does not exist is left to the decoder, which says so.
    """
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
    """Inputs listed one per line; blank lines and ``#`` comments skipped.

    ``stream`` should decode with ``surrogateescape`` (as :func:`read_sources` opens it), so that a
    name that is not UTF-8 is the name ``os.fsdecode`` gives, not an error.

    Raises:
        InvalidArgumentError: the list cannot be read; the message names ``name`` and the line.
    """
    number = 0
    lines = iter(stream)
    while True:
        try:
            line = next(lines, None)
        except (OSError, UnicodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise InvalidArgumentError(f"--from-file {name}, line {number + 1}: cannot read it ({why})") from e
        if line is None:
            return
        number += 1
        line = line.strip()
        if line and not line.startswith("#"):
            yield line


def read_sources(inputs: Sequence[str], from_file: str | None, stack: ExitStack) -> Iterator[str]:
    """``inputs``, then the lines of the list file ``from_file`` (``"-"``: standard input), lazily.

    Args:
        inputs: paths, directories and URLs.
        from_file: a list of more of them, one per line; ``None``: none.
        stack: closes the list file.

    Lines are decoded as UTF-8 with ``surrogateescape``: a name that is not UTF-8 stays the file's
    name (see :mod:`convnets.inference.names`).

    Raises:
        InvalidArgumentError: the list file cannot be read (on the first ``next`` past ``inputs``), or
            a line of it (the message names the file and the line).
    """
    import sys

    yield from inputs
    if from_file == "-":
        reconfigure = getattr(sys.stdin, "reconfigure", None)
        if reconfigure is not None:  # names as os.fsdecode gives them (before anything is read)
            try:
                reconfigure(encoding="utf-8", errors="surrogateescape")
            except (ValueError, OSError):
                pass
        yield from read_list(sys.stdin, "-")
    elif from_file is not None:
        try:
            # surrogateescape: a line that is not UTF-8 is the name os.fsdecode gives (bytes-safe).
            stream = stack.enter_context(open(from_file, encoding="utf-8", errors="surrogateescape"))
        except OSError as e:
            raise InvalidArgumentError(f"--from-file {from_file}: cannot read it ({e.strerror})") from e
        yield from read_list(stream, from_file)
