"""Contact sheets of predictions: each image as a thumbnail with its top classes, as upstream's notebook
shows them (``img.thumbnail((256, 256))`` and the top-5 list under it), without a notebook.

Used by ``convnets predict --show FILE.png``; also usable on :func:`convnets.inference.predict.iter_predict`'s
results (or :func:`~convnets.inference.predict.predict`'s list)::

    results = convnets.inference.predict.iter_predict(model, ["photos/"], topk=5)
    write_contact_sheets(results, "photos.png")   # photos.png, photos-2.png, ... 64 images each

Streaming: a sheet is drawn and written (atomically, :mod:`convnets.fileio`, and without ``overwrite``
only under a name that is still free then: a sheet that someone else created meanwhile is never
replaced) as soon as its
``per_sheet`` results have arrived, on a background thread, so the caller's loop goes on while it is
drawn; at most one sheet being collected and one being drawn are held, whatever the number of inputs.

Thumbnails are read again from each input (files re-read, URLs downloaded again with the same
``timeout``) when its sheet is drawn: predictions carry no pixels, and keeping them in the prediction
pipeline would cost every run that shows nothing. An input whose second read fails keeps its tile and
its classes, with the reason in place of the picture. An input that could not be predicted at all has a
tile too, tinted red, with the reason in words: a sheet shows every input in input order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw, ImageFont

from convnets.constants import DEFAULT_TIMEOUT
from convnets.errors import Interface, InvalidArgumentError, UnknownArgumentError, message_for
from convnets.fileio import atomic_write, directory_problem
from convnets.inference.names import display_name

if TYPE_CHECKING:
    from types import TracebackType

    from convnets.inference.predict import Prediction

__all__ = ["SHEET_SIZE", "ContactSheetWriter", "check_sheet_destination", "existing_sheets", "sheet_path",
           "write_contact_sheets"]

log = logging.getLogger(__name__)

#: Images per sheet: 8 x 8 thumbnails of 256 pixels keep a sheet readable on a screen.
SHEET_SIZE = 64

# Colours (RGB).
_PAPER = (255, 255, 255)
_FRAME = (236, 236, 236)  # behind a thumbnail that does not fill its square
_INK = (25, 25, 25)
_GREY_INK = (90, 90, 90)
_BAR = (203, 222, 240)  # probability bars
_TOP_BAR = (158, 196, 230)  # the best class's bar
_FAILED = (250, 222, 222)
_FAILED_INK = (150, 0, 0)
_ELLIPSIS = "\u2026"


def sheet_path(path: str | os.PathLike[str], number: int) -> Path:
    """The file of sheet ``number`` (1-based): ``FILE.png``, then ``FILE-2.png``, ``FILE-3.png``, ..."""
    path = Path(path)
    return path if number == 1 else path.with_name(f"{path.stem}-{number}{path.suffix}")


def existing_sheets(path: str | os.PathLike[str]) -> list[Path]:
    """The files named as sheets of ``path`` that exist: ``FILE.png`` and any ``FILE-N.png``, in order."""
    path = Path(path)
    pattern = re.compile(rf"^{re.escape(path.stem)}-([0-9]+){re.escape(path.suffix)}$")
    try:
        names = os.listdir(path.parent)
    except OSError:
        names = []
    numbered = sorted((int(m.group(1)), path.parent / name) for name in names if (m := pattern.match(name)))
    return ([path] if os.path.lexists(path) else []) + [p for number, p in numbered if number >= 2]


def check_sheet_destination(path: str | os.PathLike[str], *, option: str = "path", overwrite: bool = False) -> Path:
    """Check, before any work, that sheets can be written at ``path``.

    Args:
        path: the first sheet's file; must end in ``.png``, in an existing, writable directory.
        option: the name of ``path`` in messages: a keyword (``path``), or on the command line the
            option without dashes (``show`` gives ``--show``).
        overwrite: allow sheets that exist (``FILE.png``, ``FILE-N.png``) to be replaced by this
            run's; default: refuse them, as ``--output`` refuses an existing file.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        InvalidArgumentError: the suffix is not ``.png``, ``path`` is a directory, its directory
            does not exist or cannot be written, or (without ``overwrite``) sheets of ``path`` exist.
    """
    path = Path(path)
    python, cli = f"{option}={str(path)!r}", f"--{option} {path}"

    def refuse(problem: str, advice: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{python}: {problem}; {advice}", cli=f"{cli}: {problem}; {advice}",
                                    keyword=option)

    if path.suffix.lower() != ".png":
        raise refuse("a contact sheet is a PNG file", "give a file name ending in .png")
    if path.is_dir():
        raise refuse("is a directory", "give a file name ending in .png")
    problem = directory_problem(path.parent)
    if problem is not None:
        raise InvalidArgumentError(f"{python}: {problem}", cli=f"{cli}: {problem}", keyword=option)
    existing = [] if overwrite else existing_sheets(path)
    if existing:
        names = ", ".join(display_name(str(p)) for p in existing[:5]) + (", ..." if len(existing) > 5 else "")
        verb = "exists" if len(existing) == 1 else "exist"
        problem = f"{names} {verb}"
        raise InvalidArgumentError(f"{python}: {problem}; remove them, choose another name or pass overwrite=True",
                                   cli=f"{cli}: {problem}; remove {'it' if len(existing) == 1 else 'them'} or "
                                       "choose another name", keyword=option)
    return path


@dataclass(frozen=True)
class _Style:
    """The sheet's geometry and font."""

    thumbnail: int
    gap: int
    max_classes: int
    font: Any  # ImageFont.FreeTypeFont, or Pillow's bitmap font where FreeType is missing
    line: int  # height of a text line


def _font(size: int) -> Any:
    """Pillow's bundled scalable font at ``size`` pixels (Pillow >= 10.1 with FreeType), else its bitmap font."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, AttributeError, ImportError, OSError):  # older Pillow, or built without FreeType
        return ImageFont.load_default()


def _fit(text: str, font: Any, width: float, *, keep_end: bool = False) -> str:
    """``text`` cut with an ellipsis (at the end, or in the middle with ``keep_end``) to fit ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    lo, hi = 0, len(text)  # the longest cut that fits: binary search on the number of characters kept
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if font.getlength(_cut(text, mid, keep_end)) <= width:
            lo = mid
        else:
            hi = mid - 1
    return _cut(text, lo, keep_end)


def _cut(text: str, keep: int, keep_end: bool) -> str:
    if not keep_end:
        return text[:keep] + _ELLIPSIS
    head = keep // 3  # a path's end (the file name) says more than its start
    return text[:head] + _ELLIPSIS + text[len(text) - (keep - head):]


def _wrap(text: str, font: Any, width: float, max_lines: int) -> list[str]:
    """``text`` wrapped at spaces to ``width`` pixels (long words split), at most ``max_lines`` lines."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        candidate = f"{current} {word}" if current else word
        if font.getlength(candidate) <= width:
            current = candidate
            continue
        if current:
            lines.append(current)
        while font.getlength(word) > width:  # a word wider than the line (a long path or URL)
            cut = len(_fit(word, font, width)) - 1
            lines.append(word[:max(cut, 1)])
            word = word[max(cut, 1):]
        current = word
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = _fit(f"{lines[-1]} {_ELLIPSIS}", font, width)
    return lines


def _tile(result: Prediction, picture: Image.Image | None, why: str | None, style: _Style, classes: int,
          interface: Interface) -> Image.Image:
    """One input's tile: its picture (or the reason there is none), its name, its top classes."""
    side, font, line = style.thumbnail, style.font, style.line
    tile = Image.new("RGB", (side, side + line * (1 + classes)), _PAPER)
    draw = ImageDraw.Draw(tile)
    if not result.ok:
        draw.rectangle((0, 0, side - 1, side - 1), fill=_FAILED)
        reason = message_for(result.error, interface) if result.error is not None else "unknown error"
        _text_block(draw, "could not be read: " + reason, style, _FAILED_INK)
    elif picture is None:
        draw.rectangle((0, 0, side - 1, side - 1), fill=_FRAME)
        _text_block(draw, f"no thumbnail: {why}", style, _GREY_INK)
    else:
        draw.rectangle((0, 0, side - 1, side - 1), fill=_FRAME)
        tile.paste(picture, ((side - picture.width) // 2, (side - picture.height) // 2))
    draw.text((2, side + 1), _fit(display_name(result.input), font, side - 4, keep_end=True), font=font, fill=_INK)
    for rank, top in enumerate(result.top[:classes]):
        y = side + line * (rank + 1)
        width = round((side - 1) * min(max(top.probability, 0.0), 1.0))
        if width:
            draw.rectangle((0, y + 1, width, y + line - 2), fill=_TOP_BAR if rank == 0 else _BAR)
        percent = f"{100 * top.probability:.1f}%"
        column = font.getlength("100.0%")
        draw.text((2 + column - font.getlength(percent), y + 1), percent, font=font, fill=_INK)  # right-aligned
        left = 8 + column
        draw.text((left, y + 1), _fit(top.label, font, side - left - 2), font=font, fill=_INK)
    return tile


def _text_block(draw: ImageDraw.ImageDraw, text: str, style: _Style, fill: tuple[int, int, int]) -> None:
    """``text`` wrapped inside the picture's square."""
    pad = 6
    lines = _wrap(display_name(text), style.font, style.thumbnail - 2 * pad, (style.thumbnail - 2 * pad) // style.line)
    for i, part in enumerate(lines):
        draw.text((pad, pad + i * style.line), part, font=style.font, fill=fill)


def _draw_sheet(results: list[Prediction], path: Path, style: _Style, columns: int, timeout: float,
                allow_private: bool, interface: Interface, overwrite: bool) -> None:
    """Draw the tiles of ``results`` in rows of ``columns`` and write the PNG atomically (without
    ``overwrite``: only if ``path`` does not exist by then)."""
    from convnets.preprocessing.pipeline import load_thumbnail  # PIL + requests (+ torch): only when drawing

    classes = min(style.max_classes, max(len(r.top) for r in results))
    tiles = []
    for result in results:
        picture, why = (load_thumbnail(result.input, style.thumbnail, timeout=timeout, allow_private=allow_private,
                                       interface=interface) if result.ok else (None, None))
        tiles.append(_tile(result, picture, why, style, classes, interface))
    columns = min(columns, len(tiles))
    rows = math.ceil(len(tiles) / columns)
    width, height = tiles[0].size
    sheet = Image.new("RGB", (style.gap + columns * (width + style.gap), style.gap + rows * (height + style.gap)),
                      _PAPER)
    for i, tile in enumerate(tiles):
        row, column = divmod(i, columns)
        sheet.paste(tile, (style.gap + column * (width + style.gap), style.gap + row * (height + style.gap)))
    try:
        atomic_write(path, lambda f: sheet.save(f, format="PNG"), exclusive=not overwrite)
    except FileExistsError as e:
        # Checked absent when the run started: someone else created it since. Theirs stays.
        problem = (f"{path} was created by someone else while this run drew it; it is left as it is and this "
                   "sheet is not written")
        raise InvalidArgumentError(f"{problem}: pass another path, or overwrite=True", keyword="overwrite",
                                   cli=f"--show: {problem}: choose another --show") from e
    log.info("wrote %s (%d images)", path, len(results))


class ContactSheetWriter:
    """Collects predictions and writes a sheet each ``per_sheet`` of them (see the module docstring).

    Use it as a context manager (leaving the block without an error writes the last sheet) or call
    :meth:`close`. Sheets are ``path``, then ``sheet_path(path, 2)``, ...; existing sheets of ``path``
    are refused unless ``overwrite``, and no file is ever deleted (with ``overwrite``, an earlier
    run's ``FILE-3.png`` stays when this run writes two).

    Args:
        path: the first sheet's file (``.png``, in a writable directory; checked at once).
        per_sheet: images per sheet.
        columns: thumbnails per row (a sheet with fewer images has as many columns as images).
        thumbnail_size: side of each thumbnail's square, in pixels (upstream's notebook: 256).
        max_classes: top classes written under each thumbnail, at most (predictions with more show
            their first ones).
        font_size: text height in pixels.
        gap: white space between and around the tiles, in pixels.
        timeout: total seconds allowed for each URL's second download.
        allow_private: download URLs whose host is a loopback, private or link-local address
            (default); pass what the predictions were made with.
        interface: the words of the errors written on failed inputs' tiles: ``"python"`` or ``"cli"``.
        overwrite: replace existing sheets of ``path`` (default: refuse them).

    Raises:
        InvalidArgumentError: a bad ``path`` (see :func:`check_sheet_destination`) or size.
    """

    def __init__(self, path: str | os.PathLike[str], *, per_sheet: int = SHEET_SIZE, columns: int = 8,
                 thumbnail_size: int = 256, max_classes: int = 10, font_size: int = 14, gap: int = 8,
                 timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True,
                 interface: Interface = "python", overwrite: bool = False) -> None:
        for name, value, least in (("per_sheet", per_sheet, 1), ("columns", columns, 1),
                                   ("thumbnail_size", thumbnail_size, 32), ("max_classes", max_classes, 0),
                                   ("font_size", font_size, 6), ("gap", gap, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(f"{name} must be an integer of at least {least}, got {value!r}")
        self.path = check_sheet_destination(path, overwrite=overwrite)
        self.per_sheet, self.columns, self.timeout, self.interface = per_sheet, columns, timeout, interface
        self.overwrite = overwrite
        self.allow_private = allow_private
        font = _font(font_size)
        left, top, right, bottom = font.getbbox("Ag|%")
        self._style = _Style(thumbnail_size, gap, max_classes, font, line=bottom - min(top, 0) + 5)
        #: The sheets written so far, in order.
        self.paths: list[Path] = []
        self._collected: list[Prediction] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="convnets-sheet")
        self._drawing: concurrent.futures.Future[None] | None = None
        self._closed = False

    def add(self, result: Prediction) -> None:
        """Add the next prediction; a full sheet goes to the background thread to be drawn and written.

        Raises:
            OSError: writing the previous sheet failed (the error is raised here, in the
                caller's thread).
        """
        if self._closed:
            raise InvalidArgumentError("this ContactSheetWriter is closed")
        self._collected.append(result)
        if len(self._collected) == self.per_sheet:
            self._submit()

    def _submit(self) -> None:
        self._wait()  # one sheet drawn at a time: memory stays bounded when drawing is slower than predicting
        path = sheet_path(self.path, len(self.paths) + 1)
        results, self._collected = self._collected, []
        self._drawing = self._pool.submit(_draw_sheet, results, path, self._style, self.columns, self.timeout,
                                          self.allow_private, self.interface, self.overwrite)
        self.paths.append(path)

    def _wait(self) -> None:
        if self._drawing is not None:
            drawing, self._drawing = self._drawing, None
            drawing.result()

    def close(self) -> list[Path]:
        """Write the last sheet and wait for the drawing to finish.

        Returns:
            The sheets written, in order (none when no prediction was added).
        """
        if self._closed:
            return self.paths
        self._closed = True
        try:
            if self._collected:
                self._submit()
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
        return self.paths

    def abort(self) -> None:
        """Stop without writing the sheet being collected (sheets already handed over are finished)."""
        self._closed = True
        self._collected = []
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ContactSheetWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


_WRITER_OPTIONS = frozenset({"per_sheet", "columns", "thumbnail_size", "max_classes", "font_size", "gap", "timeout",
                             "allow_private", "interface", "overwrite"})


def write_contact_sheets(results: Iterable[Prediction], path: str | os.PathLike[str], **options: Any) -> list[Path]:
    """Write contact sheets of ``results`` (e.g. :func:`convnets.inference.predict.predict`'s), streaming.

    Args:
        results: predictions in order; any iterable, consumed once.
        path: the first sheet's file (``.png``); more sheets are ``FILE-2.png``, ... (:func:`sheet_path`).
        **options: as for :class:`ContactSheetWriter` (``per_sheet``, ``columns``, ``thumbnail_size``,
            ``max_classes``, ``font_size``, ``gap``, ``timeout``, ``allow_private``, ``interface``,
            ``overwrite``).

    Returns:
        The sheets written, in order.
    """
    unknown = sorted(set(options) - _WRITER_OPTIONS)
    if unknown:
        raise UnknownArgumentError(f"write_contact_sheets() got unknown keyword {unknown[0]!r}; it takes "
                                   f"{', '.join(sorted(_WRITER_OPTIONS))}")
    with ContactSheetWriter(path, **options) as writer:
        for result in results:
            writer.add(result)
    return writer.paths

