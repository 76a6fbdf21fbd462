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

__all__ = ["InputItem", "Listing", "expand_inputs", "iter_chunks", "iter_inputs", "look", "read_list",
           "read_sources"]

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
        yield from _listed(item, None if is_url(item) else _mode(item), recursive)


def _mode(item: str) -> int | None:
    """``item``'s ``st_mode`` (following links); ``None`` if it cannot be looked at (missing, no permission, NUL)."""
    try:
        return os.stat(item).st_mode
    except (OSError, ValueError):
        return None


def _listed(item: str, mode: int | None, recursive: bool) -> Iterator[InputItem]:
    """The items of one input whose mode was looked at (``None``: a URL, or a path that cannot be)."""
    if mode is not None and stat.S_ISDIR(mode):
        found = False
        for image in _walk(item, recursive):
            found = True
            yield image, None
        if not found:
            where = "or its subfolders " if recursive else ""
            yield item, ImageLoadError(f"Cannot load images from {item!r}: the directory {where}has no files "
                                       f"ending in {', '.join(sorted(IMAGE_SUFFIXES))}.")
    elif "\0" in item:
        yield item, ImageLoadError(f"Cannot load image {item!r}: a path cannot contain a NUL byte.")
    elif mode is None or stat.S_ISREG(mode):  # a URL, or a missing file: the decoder's to say
        yield item, None
    else:
        yield item, ImageLoadError(f"Cannot load image {item!r}: it is {file_kind(mode)}, not a regular file; give "
                                   "image files.")


class Listing:
    """The command line's INPUTs, each looked at once, as it is listed (``prepare``, before anything heavy is
    imported): one that does not exist, a directory without images or a file that is not an image is refused
    then. A directory's walk, begun to find its first image, is resumed by the iteration (the run), not begun
    again. Iterating once gives :func:`iter_inputs`' items.

    Attributes:
        total: how many items the iteration gives, when no input is a directory (else ``None``).

    Raises:
        InvalidArgumentError: an input refused (the message names ``name``: ``INPUT``).
    """

    def __init__(self, inputs: Sequence[str], *, recursive: bool = False, name: str = "INPUT") -> None:
        self._parts: list[Iterator[InputItem]] = []
        self.total: int | None = len(inputs)
        for item in inputs:
            mode = None if is_url(item) else look(name, item)
            items = _listed(item, mode, recursive)
            if mode is not None and stat.S_ISDIR(mode):
                self.total = None
                first = next(items)
                if first[1] is not None and os.access(item, os.R_OK | os.X_OK):
                    where = "nor do its subfolders" if recursive else "(--recursive also searches its subfolders)"
                    raise InvalidArgumentError(f"{name} {item} holds no images {where}: no files ending in "
                                               f"{', '.join(sorted(IMAGE_SUFFIXES))}")
                items = itertools.chain([first], items)
            elif (mode is not None and stat.S_ISREG(mode) and os.path.splitext(item)[1].lower() not in IMAGE_SUFFIXES
                  and not _is_image_file(item)):
                raise InvalidArgumentError(f"{name} {item} is not an image (Pillow does not recognise it); give image "
                                           f"files or directories of them, or, for a list of inputs one per line, "
                                           f"--from-file {item}")
            self._parts.append(items)

    def __iter__(self) -> Iterator[InputItem]:
        for items in self._parts:
            yield from items


def look(name: str, value: str | os.PathLike[str]) -> int | None:
    """The ``st_mode`` of the local path ``value`` of option ``name`` (``INPUT``, ``--weights``), ``None`` if it
    cannot be looked at (a permission denied, a NUL byte: what reads it reports that, naming it).

    Raises:
        InvalidArgumentError: it does not exist (the message adds the working directory to a relative path).
    """
    try:
        return os.stat(value).st_mode
    except (FileNotFoundError, NotADirectoryError):
        where = "" if os.path.isabs(value) else f" (in the working directory {os.getcwd()!r})"
        raise InvalidArgumentError(f"{name} {os.fspath(value)} does not exist{where}") from None
    except (OSError, ValueError):
        return None


def _is_image_file(path: str) -> bool:
    """Whether Pillow recognises the file's header (an error other than not recognising it: ``True``, for the
    run to report)."""
    from PIL import Image, UnidentifiedImageError  # only for a file not named like an image

    try:
        with Image.open(path):
            return True
    except UnidentifiedImageError:
        return False
    except Exception:  # a bomb, an unreadable file: the decoder's to say, naming the input
        return True


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
