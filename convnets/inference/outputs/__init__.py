"""The files that ``convnets predict`` and ``convnets embed`` write (``--output FILE``), and their formats.

A run appends to a resumable spool (:mod:`~convnets.inference.outputs.spool`); FILE is written from it
at the end, atomically, so a killed run leaves the spool, never a half FILE. Formats are plug-ins: a
module of this package with an :class:`~convnets.inference.outputs.base.OutputFormat` ``FORMAT``
(found by :data:`OUTPUT_FORMATS`, a :class:`~convnets.plugins.Registry`: a new format is one file), or one added
with :func:`register_format`.
"""

from __future__ import annotations

import logging
import os
import pkgutil
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from convnets.errors import InvalidArgumentError
from convnets.inference.outputs.base import OutputFormat
from convnets.inference.outputs.spool import (ScanResult, SpoolWriter, check_resumable, open_spool, scan, spool_path,
                                              write_spool)
from convnets.plugins import Registry

__all__ = ["KINDS", "OUTPUT_FORMATS", "Output", "OutputFormat", "output_formats", "register_format", "suffix_format", "suffixes"]

log = logging.getLogger(__name__)

#: What a file holds, and what a message calls its format.
KINDS = {"predictions": "format", "embeddings": "embedding format"}
#: The modules of this package that are not formats; every other one defines ``FORMAT``.
_NOT_FORMATS = frozenset({"base", "spool"})
#: Every output format: this package's modules (by name; each with its ``FORMAT``), then any registered.
OUTPUT_FORMATS: Registry[OutputFormat] = Registry(
    "output format", OutputFormat, package=__name__, attribute="FORMAT",
    # every module of this package but base and spool is the format of its own name
    builtin=lambda: {m: m for m in sorted(m.name for m in pkgutil.iter_modules(__path__)) if m not in _NOT_FORMATS})


def register_format(fmt: OutputFormat) -> OutputFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` (refused if another format has it) and return it."""
    return OUTPUT_FORMATS.register(fmt)


def output_formats(kind: str | None = None) -> tuple[OutputFormat, ...]:
    """The registered formats (that hold ``kind``): this package's, by module name, then any others."""
    return tuple(f for f in OUTPUT_FORMATS.all() if kind is None or kind in f.holds)


def suffixes(kind: str) -> dict[str, str]:
    """Suffix -> format name, for the formats that hold ``kind``."""
    return {suffix: f.name for f in output_formats(kind) for suffix in f.suffixes}


def suffix_format(path: str | os.PathLike[str], formats: Mapping[str, str], *, option: str = "output",
                  kind: str = "format") -> str:
    """The format that ``path``'s suffix names in ``formats`` (suffix -> name); an unknown one is refused,
    naming ``path`` as ``option`` and its format as ``kind``."""
    suffix = Path(path).suffix.lower()
    if suffix not in formats:
        problem = f"unknown {kind} {suffix or '(no suffix)'!r}; end the file name in {', '.join(formats)}"
        raise InvalidArgumentError(f"{option}={str(path)!r}: {problem}", cli=f"--{option} {path}: {problem}")
    return formats[suffix]


@dataclass(frozen=True)
class Output:
    """A run's output file of ``kind`` in ``format``, and its spools (build it with :meth:`of`).

    The driver calls :meth:`claim` before the model loads, :meth:`open` for the spool, and :meth:`finish` once
    it has closed the spool.
    """

    path: Path
    kind: str
    format: OutputFormat
    option: str = "output"

    @classmethod
    def of(cls, path: str | os.PathLike[str], kind: str, *, option: str = "output") -> Output:
        """The output ``path``, its format picked by its suffix (and checked: :meth:`OutputFormat.check`)."""
        name = suffix_format(path, suffixes(kind), option=option, kind=KINDS[kind])
        fmt = next(f for f in output_formats(kind) if f.name == name)
        fmt.check()
        return cls(Path(path), kind, fmt, option)

    def spool(self) -> Path:
        """The spool of the run."""
        return spool_path(self.path)

    def claim(self, *, resume: bool) -> bool:
        """Before the run: refuse to overwrite FILE or a spool, or to resume from what is not a regular file;
        ``False``: a resumed FILE is complete (nothing to do)."""
        left = [s for s in [self.spool()] if os.path.lexists(s)]
        if not resume and left:
            raise InvalidArgumentError(f"{left[0]} exists: a stopped run left it; pass resume=True to continue it, or "
                                       "delete it", keyword="resume",
                                       cli=f"{left[0]} exists: a stopped run left it; pass --resume to continue it, or "
                                           "delete it")
        readable = self.kind in self.format.readable
        if not resume and os.path.lexists(self.path):
            again = ("pass resume=True to continue it, or choose another file", "pass --resume to continue it, or "
                     "remove it or choose another file") if readable else ("choose another file or remove it",) * 2
            raise InvalidArgumentError(f"{self.option}={str(self.path)!r} exists; {again[0]}", keyword="resume",
                                       cli=f"--{self.option} {self.path} exists; {again[1]}")
        if not resume:
            return True
        for path in left or [self.path]:
            check_resumable(path, option=self.option)
        return bool(left) or readable or not self.path.exists()

    def open(self, spool: Path, *, resume: bool, width: int, stack: ExitStack) -> tuple[SpoolWriter, ScanResult | None]:
        """Open the ``spool`` for appending (closed when ``stack`` unwinds): a new one, or with ``resume``
        the one left (or FILE read back), of ``width``; returns the writer and what :func:`scan` found, if resumed."""
        adopt = resume and spool == self.spool() and not spool.exists() and self.path.exists()
        if adopt:
            write_spool(spool, self.format.read(self.path, self.kind))
        try:
            found = scan(spool, kind=self.kind, width=width) if resume and spool.exists() else None
        except InvalidArgumentError:
            if adopt:  # made just now from FILE, which stays as it was
                spool.unlink()
            raise
        if adopt:
            stack.push(_drop_if_unchanged(spool))
        return stack.enter_context(open_spool(spool, append=found is not None)), found

    def finish(self, *, batch_size: int, width: int) -> int:
        """Write FILE from the spool and remove the spool; returns the records written."""
        spool = self.spool()
        count = self.format.write(self.path, spool, kind=self.kind, width=width, batch_size=batch_size)
        spool.unlink()
        log.info("%s: %d records", self.path, count)
        return count


def _drop_if_unchanged(spool: Path) -> Callable[..., bool]:
    """An exit callback: after an error, remove ``spool`` (read back from FILE) if nothing was appended to it."""
    size = spool.stat().st_size

    def drop(kind: type[BaseException] | None, *_: object) -> bool:
        if kind is not None and spool.stat().st_size == size:
            spool.unlink()
        return False
    return drop
