"""``.jsonl``: one prediction record per line, the spool's own lines (see :mod:`convnets.inference.outputs.spool`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from convnets.inference.outputs.base import OutputFormat
from convnets.inference.outputs.spool import Record, read_spool

__all__ = ["FORMAT", "Jsonl"]


class Jsonl(OutputFormat):
    name = "jsonl"
    suffixes = (".jsonl",)
    holds = {"predictions": "one JSON object per input: input, top or error"}
    readable = frozenset({"predictions"})

    def write(self, path: Path, spool: Path, *, kind: str, width: int, batch_size: int) -> int:
        from convnets.fileio import atomic_output

        count = 0
        with atomic_output(path) as out, open(spool, "rb") as f:  # the spool's lines are the file's, byte for byte
            for count, line in enumerate(f, 1):  # noqa: B007 (the count is the last one)
                out.write(line)
        return count

    def read(self, path: Path, kind: str) -> Iterator[Record]:
        # A torn tail is cut and a last record without its newline kept, as in a spool.
        return read_spool(path)


FORMAT = Jsonl()
