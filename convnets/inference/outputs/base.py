"""What an output format is: :class:`OutputFormat`, the base of each plug-in of :mod:`convnets.inference.outputs`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from convnets.inference.outputs.spool import Record

__all__ = ["OutputFormat"]


class OutputFormat:
    """An output format: the file that a run's spool becomes at the end.

    Attributes:
        name: the registry's name (the module's).
        suffixes: the file name endings that pick it (lower case, with the dot).
        holds: the kinds it holds (``"predictions"``, ``"embeddings"``), each with a few words for ``--help``.
        readable: the kinds whose finished files :meth:`read` gives back (for ``--resume``).
    """

    name: ClassVar[str]
    suffixes: ClassVar[tuple[str, ...]]
    holds: ClassVar[dict[str, str]]
    readable: ClassVar[frozenset[str]] = frozenset()

    def check(self) -> None:
        """Before the run: raise if what writing the format needs is missing (default: nothing)."""

    def write(self, path: Path, spool: Path, *, kind: str, width: int, batch_size: int) -> int:
        """Write ``path`` atomically from the complete ``spool`` (read as often as needed), its records of
        ``width`` values, in the run's batches of ``batch_size``; returns the rows written."""
        raise NotImplementedError

    def read(self, path: Path, kind: str) -> Iterator[Record]:
        """The records of the finished file ``path`` of a ``readable`` kind, in order, lazily."""
        raise NotImplementedError(f"{self.name} files of {kind} cannot be read back")

