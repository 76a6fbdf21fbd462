"""``.npy``: the embeddings, float32 ``[N, D]``, and their inputs in ``FILE.npy.inputs.txt``, one text cell
per line (:func:`read_inputs_list`). Inputs that could not be read have no row."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from convnets.inputs.names import decode_name, encode_name
from convnets.inference.outputs.base import OutputFormat
from convnets.inference.outputs.spool import Record, read_spool

__all__ = ["FORMAT", "Npy", "inputs_path", "read_inputs_list"]


class Npy(OutputFormat):
    name = "npy"
    suffixes = (".npy",)
    holds = {"embeddings": "float32 [N, D]; the inputs, one per line, in FILE.inputs.txt"}

    def write(self, path: Path, spool: Path, *, kind: str, width: int, batch_size: int) -> int:
        import numpy as np

        from convnets.fileio import atomic_output

        def vectors() -> Iterator[Record]:  # read again for each pass: memory stays bounded
            return (r for r in read_spool(spool, kind) if "error" not in r)
        count = sum(1 for _ in vectors())
        with atomic_output(inputs_path(path)) as f:
            f.writelines(encode_name(r["input"]).encode("utf-8") + b"\n" for r in vectors())
        with atomic_output(path) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (count, width)})
            f.writelines(r["embedding"].tobytes() for r in vectors())
        return count


def inputs_path(path: str | os.PathLike[str]) -> Path:
    """The list of inputs that goes with the ``.npy`` file ``path``: ``FILE.inputs.txt``."""
    path = Path(path)
    return path.with_name(path.name + ".inputs.txt")


def read_inputs_list(path: str | os.PathLike[str]) -> Iterator[str]:
    """The inputs of the ``.npy`` file ``path``, in the order of its rows (names decoded)."""
    with open(inputs_path(path), encoding="utf-8", newline="\n") as f:
        for line in f:
            yield decode_name(line[:-1] if line.endswith("\n") else line)


FORMAT = Npy()
