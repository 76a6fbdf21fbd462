"""Contact sheets of predictions (``convnets predict --show FILE.png``): thumbnails with their top classes
and bars, 64 per sheet, failed inputs in red::

    results = iter_predict(model, ["photos/"], topk=5, decoding=Decoding(thumbnail=256))
    write_contact_sheets(results, "photos.png")   # photos.png, photos-2.png, ...
"""

from __future__ import annotations

import math
import os
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, ImageDraw, ImageFont

from convnets.constants import DEFAULT_TIMEOUT
from convnets.errors import Interface, InvalidArgumentError, UnknownArgumentError, message_for
from convnets.fileio import atomic_write
from convnets.paths import directory_problem
from convnets.inputs.names import safe_text

if TYPE_CHECKING:
    from convnets.inference.predict import Prediction

__all__ = ["SHEET_SIZE", "ContactSheetWriter", "check_sheet_destination", "existing_sheets", "sheet_path",
           "write_contact_sheets"]

#: Images per sheet: 8 x 8 thumbnails of 256 pixels keep a sheet readable on a screen.
SHEET_SIZE = 64

# Colours (RGB): paper, the frame behind a thumbnail, ink, probability bars (the best class darker), failures.
_PAPER, _FRAME, _INK, _GREY_INK = (255, 255, 255), (236, 236, 236), (25, 25, 25), (90, 90, 90)
_BAR, _TOP_BAR, _FAILED, _FAILED_INK = (203, 222, 240), (158, 196, 230), (250, 222, 222), (150, 0, 0)
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


def check_sheet_destination(path: str | os.PathLike[str], *, option: str = "path", force: bool = False) -> Path:
    """Check, before any work, that sheets can be written at ``path`` (``.png``, in a writable directory, no
    sheets of it unless ``force``; ``option``: its name in messages); returns it as a :class:`~pathlib.Path`."""
    path = Path(path)
    python, cli = f"{option}={str(path)!r}", f"--{option} {path}"

    def refuse(problem: str, advice: str, cli_advice: str | None = None) -> InvalidArgumentError:
        return InvalidArgumentError(f"{python}: {problem}{advice}", cli=f"{cli}: {problem}{cli_advice or advice}",
                                    keyword=option)

    if path.suffix.lower() != ".png":
        raise refuse("a contact sheet is a PNG file", "; give a file name ending in .png")
    if path.is_dir():
        raise refuse("is a directory", "; give a file name ending in .png")
    problem = directory_problem(path.parent)
    if problem is not None:
        raise refuse(problem, "")
    existing = [] if force else existing_sheets(path)
    if existing:
        names = ", ".join(safe_text(str(p)) for p in existing[:5]) + (", ..." if len(existing) > 5 else "")
        them = "it" if len(existing) == 1 else "them"
        raise refuse(f"{names} {'exists' if len(existing) == 1 else 'exist'}",
                     "; remove them, choose another name or pass force=True",
                     f"; remove {them} or choose another name")
    return path


def _fit(text: str, font: Any, width: float, *, keep_end: bool = False) -> str:
    """``text`` cut with an ellipsis to fit ``width`` pixels, at its end or with ``keep_end`` at its start."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(_ELLIPSIS + text if keep_end else text + _ELLIPSIS) > width:
        text = text[1:] if keep_end else text[:-1]
    return _ELLIPSIS + text if keep_end else text + _ELLIPSIS


class ContactSheetWriter:
    """Collects predictions and writes a sheet each ``per_sheet`` of them: ``path``, then ``sheet_path(path, 2)``, ...
    (leaving its ``with`` block without an error, or :meth:`close`, writes the last one; no file is ever deleted).

    Args:
        path, force: as for :func:`check_sheet_destination` (checked at once).
        thumbnail_size, font_size, gap: in pixels.
        timeout, allow_private: for reading again a URL predicted without a thumbnail.
        interface: the words of the errors on failed inputs' tiles: ``"python"`` or ``"cli"``.
    """

    def __init__(self, path: str | os.PathLike[str], *, per_sheet: int = SHEET_SIZE, columns: int = 8,
                 thumbnail_size: int = 256, max_classes: int = 10, font_size: int = 14, gap: int = 8,
                 timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True,
                 interface: Interface = "python", force: bool = False) -> None:
        for name, value, least in (("per_sheet", per_sheet, 1), ("columns", columns, 1),
                                   ("thumbnail_size", thumbnail_size, 32), ("max_classes", max_classes, 0),
                                   ("font_size", font_size, 6), ("gap", gap, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgumentError(f"{name} must be an integer of at least {least}, got {value!r}")
        self.path = check_sheet_destination(path, force=force)
        self.per_sheet, self.columns, self.side, self.max_classes, self.gap = (per_sheet, columns, thumbnail_size,
                                                                               max_classes, gap)
        self.timeout, self.allow_private, self.interface, self.force = timeout, allow_private, interface, force
        try:  # Pillow's bundled scalable font (Pillow >= 10.1 with FreeType), else its bitmap font
            self.font: Any = ImageFont.load_default(size=font_size)
        except (TypeError, AttributeError, ImportError, OSError):
            self.font = ImageFont.load_default()
        left, top, right, bottom = self.font.getbbox("Ag|%")
        self.line = bottom - min(top, 0) + 5
        self.paths: list[Path] = []
        self._collected: list[Prediction] = []
        self._closed = False

    def add(self, result: Prediction) -> None:
        """Add the next prediction; the one that fills a sheet writes it (refused if its file appeared meanwhile)."""
        if self._closed:
            raise InvalidArgumentError("this ContactSheetWriter is closed")
        self._collected.append(result)
        if len(self._collected) == self.per_sheet:
            self._write()

    def close(self) -> list[Path]:
        """Write the last sheet; returns the sheets written, in order (none when nothing was added)."""
        if not self._closed and self._collected:
            self._write()
        self._closed = True
        return self.paths

    def abort(self) -> None:
        """Stop without writing the sheet being collected."""
        self._closed, self._collected = True, []

    def __enter__(self) -> ContactSheetWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _write(self) -> None:
        results, self._collected = self._collected, []
        path = sheet_path(self.path, len(self.paths) + 1)
        classes = min(self.max_classes, max(len(r.top) for r in results))
        tiles = [self._tile(result, classes) for result in results]
        columns, (width, height), gap = min(self.columns, len(tiles)), tiles[0].size, self.gap
        rows = math.ceil(len(tiles) / columns)
        sheet = Image.new("RGB", (gap + columns * (width + gap), gap + rows * (height + gap)), _PAPER)
        for i, tile in enumerate(tiles):
            row, column = divmod(i, columns)
            sheet.paste(tile, (gap + column * (width + gap), gap + row * (height + gap)))
        try:
            atomic_write(path, lambda f: sheet.save(f, format="PNG"), exclusive=not self.force)
        except FileExistsError as e:  # checked free at the start: someone else created it since; theirs stays
            self.abort()
            problem = f"{path} was created by someone else while this run drew it; it is left as it is and this " \
                      "sheet is not written"
            raise InvalidArgumentError(f"{problem}: pass another path, or force=True", keyword="force",
                                       cli=f"--show: {problem}: choose another --show") from e
        self.paths.append(path)

    def _tile(self, result: Prediction, classes: int) -> Image.Image:
        """One input's tile: its picture (or the reason there is none), its name, its top classes."""
        side, font, line = self.side, self.font, self.line
        tile = Image.new("RGB", (side, side + line * (1 + classes)), _PAPER)
        draw = ImageDraw.Draw(tile)
        from convnets.preprocessing.decode import load_thumbnail, thumbnail_of  # torch: not at the CLI's start

        draw.rectangle((0, 0, side - 1, side - 1), fill=_FRAME if result.ok else _FAILED)
        picture, why, ink = result.thumbnail, None, _GREY_INK
        if result.error is not None:
            why, ink = "could not be read: " + message_for(result.error, self.interface), _FAILED_INK
        elif picture is None:  # predicted without a thumbnail: read again
            picture, why = load_thumbnail(result.input, side, timeout=self.timeout, allow_private=self.allow_private,
                                          interface=self.interface)
            why = None if picture is not None else f"no thumbnail: {why}"
        if picture is not None:
            picture = thumbnail_of(picture, side)  # as it is when decoded at this size
            tile.paste(picture, ((side - picture.width) // 2, (side - picture.height) // 2))
        elif why is not None:  # the reason, wrapped at an average letter's width, each line fitted
            chars = max(1, int((side - 12) * 26 / font.getlength("abcdefghijklmnopqrstuvwxyz")))
            for i, text in enumerate(textwrap.wrap(safe_text(why), chars, max_lines=(side - 12) // line,
                                                   placeholder=" " + _ELLIPSIS)):
                draw.text((6, 6 + i * line), _fit(text, font, side - 12), font=font, fill=ink)
        draw.text((2, side + 1), _fit(safe_text(result.input), font, side - 4, keep_end=True), font=font, fill=_INK)
        column = font.getlength("100.0%")
        for rank, top in enumerate(result.top[:classes]):
            y, percent = side + line * (rank + 1), f"{100 * top.probability:.1f}%"
            bar = round((side - 1) * min(max(top.probability, 0.0), 1.0))
            if bar:
                # The darker bar: the best class; of a multi-label model, each class above its threshold.
                chosen = rank == 0 if result.labels is None else top.label in result.labels
                draw.rectangle((0, y + 1, bar, y + line - 2), fill=_TOP_BAR if chosen else _BAR)
            draw.text((2 + column - font.getlength(percent), y + 1), percent, font=font, fill=_INK)  # right-aligned
            draw.text((8 + column, y + 1), _fit(top.label, font, side - column - 10), font=font, fill=_INK)
        return tile


_WRITER_OPTIONS = frozenset({"per_sheet", "columns", "thumbnail_size", "max_classes", "font_size", "gap", "timeout",
                             "allow_private", "interface", "force"})


def write_contact_sheets(results: Iterable[Prediction], path: str | os.PathLike[str], **options: Any) -> list[Path]:
    """Write contact sheets of ``results`` (consumed once) at ``path``, ``FILE-2.png``, ... (``options``: as for
    :class:`ContactSheetWriter`); returns them."""
    unknown = sorted(set(options) - _WRITER_OPTIONS)
    if unknown:
        raise UnknownArgumentError(f"write_contact_sheets() got unknown keyword {unknown[0]!r}; it takes "
                                   f"{', '.join(sorted(_WRITER_OPTIONS))}")
    with ContactSheetWriter(path, **options) as writer:
        for result in results:
            writer.add(result)
    return writer.paths
