"""Embedding files (``convnets embed``): a crash-safe, resumable spool, assembled into ``.npy`` or ``.parquet``.

``convnets embed`` writes one vector per readable input into ``.npy`` (float32 [N, D], the inputs in
``FILE.npy.inputs.txt``, one per line: a name with a line break or an undecodable byte, or starting
with ``"``, is a JSON string literal there; :func:`read_inputs_list` reads it back, see
:mod:`convnets.inference.names`) or ``.parquet`` (``input``, ``embedding``). Neither can be appended to after a
kill (the .npy header holds N, a Parquet footer is written last), so records stream into a spool
beside FILE (``FILE.spool``), which is crash-safe and resumable like a JSONL file, and FILE is
assembled from the spool at the end (atomically, see convnets/fileio.py), after which the spool is
deleted. The spool also records the inputs that could not be read, without a vector: a resumed run
then skips exactly the inputs already handled (a prefix of its inputs, as for predictions), keeps
batch boundaries, knows the earlier run's failures, and a sharded run's parts merge batch by batch.

Spool layout: the 8 bytes SPOOL_MAGIC, then one frame per record, little-endian:
  u32 len(input) | u32 len(error) | u32 D | input | error | D x float32 | u32 crc32
with input and error in UTF-8 (a name's undecodable bytes stored as they are: surrogateescape), and
D = 0 and a non-empty error for an unreadable input. The CRC covers the frame before it. A
killed writer leaves whole frames plus at most one partial one, which resuming cuts away.

Resume, the atomic writes and the torn-tail rule are those of the prediction records
(:mod:`convnets.inference.records`, whose helpers this module uses); a sharded run's parts are spools,
merged by :mod:`convnets.inference.shard` through :func:`read_embedding_records` and
:func:`write_embedding_records`. numpy and pyarrow are imported when records are framed or assembled.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from convnets.errors import InvalidArgumentError
from convnets.fileio import naming
from convnets.inference.names import decode_name, encode_name
from convnets.inference.records import (MAX_RECORD_BYTES, Record, ScanResult, check_resumable, cut_tail,
                                        import_pyarrow, suffix_format, write_batches)
from convnets.models.specs import MAX_CHANNELS, MAX_EXPANSION

__all__ = ["EMBEDDING_FORMATS", "SPOOL_MAGIC", "EmbeddingWriter", "SpoolScan", "assemble_embeddings",
           "check_embedding_destination", "embedding_format_of", "embedding_output_complete", "inputs_path",
           "open_embedding_writer", "read_embedding_records", "read_inputs_list", "scan_spool", "spool_path", "write_embedding_records"]

log = logging.getLogger(__name__)

#: Embedding formats by file suffix.
EMBEDDING_FORMATS: dict[str, str] = {".npy": "npy", ".parquet": "parquet"}
#: First bytes of a spool file.
SPOOL_MAGIC = b"CNVEMB1\n"
_FRAME = struct.Struct("<III")
_CRC = struct.Struct("<I")
#: Rows per Parquet row group (and per write when assembling).
_ASSEMBLE_ROWS = 1024
# The longest vector a model can give: the widest stage's output channels.
_MAX_DIM = MAX_CHANNELS * MAX_EXPANSION


def embedding_format_of(path: str | os.PathLike[str], *, option: str = "output") -> str:
    """The embedding format that ``path``'s suffix names (:data:`EMBEDDING_FORMATS`; see
    :func:`~convnets.inference.records.suffix_format`)."""
    return suffix_format(path, EMBEDDING_FORMATS, option=option, kind="embedding format")


def spool_path(path: str | os.PathLike[str]) -> Path:
    """Where the records of the embedding file ``path`` stream until it is assembled: ``FILE.spool``."""
    path = Path(path)
    return path.with_name(path.name + ".spool")


def inputs_path(path: str | os.PathLike[str]) -> Path:
    """The list of inputs that goes with an ``.npy`` embedding file: ``FILE.inputs.txt``."""
    path = Path(path)
    return path.with_name(path.name + ".inputs.txt")


def read_inputs_list(path: str | os.PathLike[str]) -> Iterator[str]:
    """The inputs of the ``.npy`` embedding file ``path``, in the order of its rows, from its
    ``FILE.npy.inputs.txt`` (names decoded: :func:`~convnets.inference.names.decode_name`)."""
    with open(inputs_path(path), encoding="utf-8", newline="\n") as f:
        for line in f:
            yield decode_name(line[:-1] if line.endswith("\n") else line)


def _frame(record: Record) -> bytes:
    name = record["input"].encode("utf-8", "surrogateescape")  # the file name's bytes (see convnets.inference.names)
    if "error" in record:
        error, vector = (record["error"] or "unreadable").encode("utf-8", "surrogateescape"), b""
        dim = 0
    else:
        import numpy as np

        array = np.ascontiguousarray(record["embedding"], dtype="<f4").reshape(-1)
        error, vector, dim = b"", array.tobytes(), array.size
    body = _FRAME.pack(len(name), len(error), dim) + name + error + vector
    return body + _CRC.pack(zlib.crc32(body))


def _spool_frames(path: Path) -> Iterator[tuple[Record | None, int]]:
    """``(record, end offset)`` per frame; a final ``(None, offset)`` for a torn (partial) last frame.

    Raises:
        InvalidArgumentError: not a spool, or a complete frame whose checksum is wrong (damage).
    """
    import numpy as np

    with open(path, "rb") as f:
        if f.read(len(SPOOL_MAGIC)) != SPOOL_MAGIC:
            raise InvalidArgumentError(f"{path} is not a convnets embed spool (it does not start with "
                                       f"{SPOOL_MAGIC!r}), so --resume cannot continue it; delete it or choose "
                                       "another --output")
        offset = len(SPOOL_MAGIC)
        while header := f.read(_FRAME.size):
            if len(header) < _FRAME.size:
                yield None, offset
                return
            name_len, error_len, dim = _FRAME.unpack(header)
            if name_len + error_len > MAX_RECORD_BYTES or dim > _MAX_DIM:
                # A header that a writer wrote whole (torn frames are cut after it) but no writer writes:
                # damage, not a tail to cut away (and reading what it claims could take gigabytes).
                raise InvalidArgumentError(
                    f"{path}: the record at byte {offset} claims a name and error of {name_len + error_len} bytes "
                    f"and {dim} values, more than any record convnets writes; the file is damaged and --resume "
                    "cannot continue it: write to a new --output")
            rest = f.read(name_len + error_len + 4 * dim + _CRC.size)
            if len(rest) < name_len + error_len + 4 * dim + _CRC.size:
                yield None, offset
                return
            body = header + rest[:-_CRC.size]
            if _CRC.unpack(rest[-_CRC.size:])[0] != zlib.crc32(body):
                raise InvalidArgumentError(f"{path}: record at byte {offset} is damaged (checksum mismatch); "
                                           "write to a new --output")
            name = rest[:name_len].decode("utf-8", "surrogateescape")
            offset += len(header) + len(rest)
            if dim == 0:
                yield {"input": name, "error": rest[name_len:name_len + error_len].decode("utf-8", "surrogateescape")}, offset
            else:
                start = name_len + error_len
                yield {"input": name, "embedding": np.frombuffer(rest[start:start + 4 * dim], dtype="<f4")}, offset


def read_embedding_records(path: str | os.PathLike[str]) -> Iterator[Record]:
    """The complete records of the spool of the embedding file ``path``, in order (lazily).

    Records are ``{"input", "embedding": float32 array}`` or ``{"input", "error"}``; a torn last
    frame is left out. The reader that merges a sharded run's parts (same interface as the
    prediction formats' readers).
    """
    for record, _ in _spool_frames(spool_path(path)):
        if record is None:
            return
        yield record


@dataclass(frozen=True)
class SpoolScan(ScanResult):
    """What :func:`scan_spool` found; ``dim``: the vectors' length (``None`` before the first one)."""

    dim: int | None = None


def scan_spool(path: str | os.PathLike[str], *, repair: bool = True) -> SpoolScan:
    """Check the spool of the embedding file ``path`` for resuming, and cut away a torn last frame.

    Raises:
        InvalidArgumentError: not a spool (or not a regular file), damage, or vectors of different lengths.
    """
    spool = spool_path(path)
    check_resumable(spool)
    records = errors = 0
    end = len(SPOOL_MAGIC)
    dim: int | None = None
    for record, record_end in _spool_frames(spool):
        if record is None:
            break
        if "error" in record:
            errors += 1
        elif dim is None:
            dim = record["embedding"].size
        elif record["embedding"].size != dim:
            raise InvalidArgumentError(f"{spool}: record {records + 1} has {record['embedding'].size} values, the "
                                       f"ones before {dim}; the file is damaged: write to a new --output")
        records += 1
        end = record_end
    size = spool.stat().st_size
    if repair:
        cut_tail(spool, end, records)
    return SpoolScan(records=records, errors=errors, end=end, torn=size - end, dim=dim)


def check_embedding_destination(path: str | os.PathLike[str], *, resume: bool, option: str = "output") -> str:
    """Check, before any work, that embeddings can go to ``path``; returns its format.

    Raises:
        InvalidArgumentError: unknown suffix; ``path`` or its spool exists and ``resume`` is off.
        MissingDependencyError: Parquet without pyarrow.
    """
    path = Path(path)
    fmt = embedding_format_of(path, option=option)
    spool = spool_path(path)
    if resume:
        check_resumable(spool, option=option)
    if not resume and spool.exists():
        raise InvalidArgumentError(f"{spool} exists: a stopped run left it; pass resume=True to continue it, or "
                                   "delete it", keyword="resume",
                                   cli=f"{spool} exists: a stopped run left it; pass --resume to continue it, or "
                                       "delete it")
    if not resume and path.exists():
        raise InvalidArgumentError(f"{option}={str(path)!r} exists; choose another file or remove it",
                                   cli=f"--{option} {path} exists; choose another file or remove it")
    if fmt == "parquet":
        import_pyarrow()
    return fmt


def embedding_output_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a finished embedding file: it exists and no spool is waiting to be assembled."""
    return Path(path).exists() and not spool_path(path).exists()


def _write(stream: IO[bytes], data: bytes) -> None:
    """Append ``data`` to the spool and flush it; a full disk's error names the spool (a write names none)."""
    try:
        stream.write(data)
        stream.flush()
    except OSError as e:
        raise naming(e, stream.name) from e


class EmbeddingWriter:
    """Streams embedding records into the spool of ``path``; :meth:`close` assembles ``path``.

    Same interface as :class:`RecordWriter`: :meth:`write` queues a record (``{"input",
    "embedding"}`` or ``{"input", "error"}``), :meth:`flush` appends the queued ones to the spool in
    one write (after each batch), :meth:`close` flushes and, with ``assemble``, writes ``path`` (and
    ``FILE.inputs.txt`` for ``.npy``) from the spool and deletes it.

    Args:
        path: the embedding file.
        stream: the spool, open for appending in binary.
        dim: the vectors' length (the shape of an empty ``.npy``; every vector is checked against it).
        assemble: build ``path`` on :meth:`close`; ``False`` leaves the spool (a shard's part, merged
            by another process).
    """

    def __init__(self, path: str | os.PathLike[str], stream: IO[bytes], *, dim: int, assemble: bool = True) -> None:
        self.path, self.stream, self.dim, self.assemble = Path(path), stream, dim, assemble
        self.format = embedding_format_of(path)
        self._pending: list[Record] = []

    def write(self, record: Record) -> None:
        """Queue one record; it reaches the spool at the next :meth:`flush`."""
        if "error" not in record and len(record["embedding"]) != self.dim:
            raise InvalidArgumentError(f"{self.path}: a vector of {len(record['embedding'])} values, this file "
                                       f"holds {self.dim}")
        self._pending.append(record)

    def flush(self) -> None:
        """Append the queued records to the spool and flush them to the operating system."""
        records, self._pending = self._pending, []
        if records:
            # One write per batch: a killed process leaves whole batches plus at most one torn frame.
            _write(self.stream, b"".join(_frame(r) for r in records))

    def close(self) -> None:
        """Flush, and with ``assemble`` write ``path`` from the spool and delete the spool."""
        self.flush()
        try:
            self.stream.close()
        except OSError as e:
            raise naming(e, self.stream.name) from e
        if self.assemble:
            assemble_embeddings(self.path, dim=self.dim)


def open_embedding_writer(path: str | os.PathLike[str], *, dim: int, resume: bool, stack: ExitStack,
                          assemble: bool = True, option: str = "output") -> tuple[EmbeddingWriter, SpoolScan | None]:
    """Open the spool of the embedding file ``path``, or continue it with ``resume``.

    Args:
        path: the ``.npy`` or ``.parquet`` file to write.
        dim: the vectors' length (a resumed spool must hold vectors of that length).
        resume: continue the spool a stopped run left (after :func:`scan_spool`); none: start anew.
        stack: closes the writer, assembling ``path``, when it unwinds without an error; on an
            error the spool stays, for ``resume``.
        assemble: see :class:`EmbeddingWriter`.
        option: the interface's name of ``path`` in messages.

    Returns:
        The writer and, when a spool is resumed, what :func:`scan_spool` found in it.

    Raises:
        InvalidArgumentError: see :func:`check_embedding_destination`; a resumed spool with other vectors.
        MissingDependencyError: Parquet without pyarrow.
    """
    check_embedding_destination(path, resume=resume, option=option)
    spool = spool_path(path)
    found = scan_spool(path) if resume and spool.exists() else None
    if found is not None and found.dim is not None and found.dim != dim:
        raise InvalidArgumentError(f"{spool} holds vectors of {found.dim} values, this run's have {dim}: resume "
                                   "with the same layer and model", keyword="layer",
                                   cli=f"{spool} holds vectors of {found.dim} values, this run's have {dim}: resume "
                                       "with the same --layer and model")
    stream = open(spool, "ab" if found else "xb")
    if not found:
        try:
            _write(stream, SPOOL_MAGIC)
        except OSError:
            with contextlib.suppress(OSError):  # closing flushes again, and fails again
                stream.close()
            spool.unlink(missing_ok=True)  # created just now, empty: a later run would take it for a stopped one
            raise
    writer = EmbeddingWriter(path, stream, dim=dim, assemble=assemble)

    def finish(kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            writer.close()
        else:  # keep what was computed, for --resume
            writer.flush()
            # After a failed write (a full disk) closing fails the same way: the first error, which
            # names the spool, is the one to report.
            with contextlib.suppress(OSError):
                stream.close()
    stack.push(finish)
    return writer, found


def write_embedding_records(path: str | os.PathLike[str], batches: Iterable[Iterable[Record]], *, dim: int) -> int:
    """Write the embedding file ``path`` from records, a batch at a time, as a run writes it (through
    its spool, assembled at the end): the writer that merges a sharded run's parts.

    Returns:
        The number of records written (vectors and unreadable inputs).
    """
    with ExitStack() as stack:
        writer, _ = open_embedding_writer(path, dim=dim, resume=False, stack=stack)
        return write_batches(writer, batches)


def assemble_embeddings(path: str | os.PathLike[str], *, dim: int) -> int:
    """Write the embedding file ``path`` from its spool (each atomically), then delete the spool.

    ``.npy``: ``FILE.npy.inputs.txt`` (one input per line, :func:`~convnets.inference.names.encode_name`) first, then ``FILE`` (float32 ``[N, dim]``);
    ``.parquet``: ``input`` (string), ``embedding`` (fixed-size list of ``dim`` float32), row groups
    of 1024. Inputs that could not be read are left out. Memory stays bounded (rows are streamed).

    Returns:
        N, the number of vectors written.
    """
    import numpy as np

    from convnets.fileio import atomic_output

    path = Path(path)
    fmt = embedding_format_of(path)

    def vectors() -> Iterator[Record]:  # read again for each pass: memory stays bounded
        return (r for r in read_embedding_records(path) if "error" not in r)
    count = sum(1 for _ in vectors())
    if fmt == "npy":
        with atomic_output(inputs_path(path)) as f:
            f.writelines(encode_name(r["input"]).encode("utf-8") + b"\n" for r in vectors())
        with atomic_output(path) as f:
            np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (count, dim)})
            f.writelines(r["embedding"].tobytes() for r in vectors())
    else:
        pa, pq = import_pyarrow()
        schema = pa.schema([("input", pa.string()), ("embedding", pa.list_(pa.float32(), dim))])
        stream = vectors()
        with atomic_output(path) as f, pq.ParquetWriter(f, schema) as parquet:
            while rows := list(itertools.islice(stream, _ASSEMBLE_ROWS)):
                values = pa.array(np.concatenate([r["embedding"] for r in rows]), type=pa.float32())
                parquet.write_table(pa.table({"input": pa.array([encode_name(r["input"]) for r in rows], type=pa.string()),
                                              "embedding": pa.FixedSizeListArray.from_arrays(values, dim)},
                                             schema=schema))
    spool_path(path).unlink()
    log.info("%s: %d vectors of %d values", path, count, dim)
    return count
