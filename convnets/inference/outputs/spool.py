"""The spool: the one append-only, resumable file that a batch run writes while it runs.

A run (``convnets predict``/``embed --output FILE``) appends one JSON line per input to
``FILE.partial.jsonl`` (:func:`spool_path`; a rank of a ``torchrun`` job to its own part,
``FILE.part-0000R-of-0000W.partial.jsonl``), one write per batch, flushed to the operating system.
FILE itself is written from the spool at the end (:mod:`convnets.inference.outputs`), after which
the spool is removed; a killed run leaves the spool, which ``--resume`` continues.

A line is a record (:data:`Record`): ``{"input": NAME, "top": [...]}`` (predictions) or ``{"input":
NAME, "embedding": BASE64}`` (embeddings: the vector's little-endian float32 bytes, read back as
the very same numbers), or ``{"input": NAME, "error": MESSAGE}``; names as in JSONL files
(:mod:`convnets.inference.names`). A killed writer leaves whole lines and at most a partial last one
without its newline: :func:`scan` cuts that torn tail away (a complete record is never cut, and a
last record that only lacks its newline is kept), and refuses, leaving the file as it is, anything
else that cannot be read (damage), a line longer than any record (:data:`MAX_RECORD_BYTES`), or a
path that is not a regular file (a FIFO, a link to ``/dev/zero``).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from convnets.errors import InvalidArgumentError
from convnets.fileio import atomic_output, file_kind, naming
from convnets.inference.names import escape_json
from convnets.models.specs import MAX_CHANNELS, MAX_EXPANSION

__all__ = ["MAX_RECORD_BYTES", "Record", "ScanResult", "SpoolWriter", "batched", "check_resumable", "dumps",
           "open_spool", "read_spool", "scan", "spool_path", "write_spool"]

log = logging.getLogger(__name__)

Record = dict[str, Any]
T = TypeVar("T")

#: The longest prediction line that reading a spool back accepts: top 1000 classes with 4 KB labels,
#: or a name of a megabyte, still fit; a longer line is damage or another kind of file, and reading
#: it whole could take any amount of memory. An embedding line may add the widest vector a model gives.
MAX_RECORD_BYTES = 4 << 20
_MAX_EMBEDDING_LINE = MAX_RECORD_BYTES + 4 * (4 * MAX_CHANNELS * MAX_EXPANSION + 2) // 3

#: What resuming with another width is called, per kind: (the unit, the option that sets it).
_WIDTH_WORDS = {"predictions": ("classes per input", "topk", "--topk"),
                "embeddings": ("values per vector", "layer", "--layer and model")}


def spool_path(output: str | os.PathLike[str], rank: int = 0, world: int = 1) -> Path:
    """The spool of ``output`` (``FILE.partial.jsonl``), or of rank ``rank``'s part of a ``world``-rank run."""
    path = Path(output)
    part = "" if world == 1 else f".part-{rank:05d}-of-{world:05d}"
    return path.with_name(f"{path.name}{part}.partial.jsonl")


def dumps(record: Record) -> str:
    """One record as its line, without the newline (a vector as base64 of its little-endian float32)."""
    if "embedding" in record:
        import numpy as np

        vector = np.ascontiguousarray(record["embedding"], dtype="<f4").reshape(-1)
        record = {"input": record["input"], "embedding": base64.b64encode(vector.tobytes()).decode("ascii")}
    return escape_json(json.dumps(record, ensure_ascii=False))


def _loads(line: bytes) -> Record | None:
    """The record on ``line``, or ``None`` when it is not one (torn or damaged)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not (isinstance(record, dict) and isinstance(record.get("input"), str)):
        return None
    if isinstance(record.get("embedding"), str):
        import numpy as np

        try:
            record["embedding"] = np.frombuffer(base64.b64decode(record["embedding"], validate=True), dtype="<f4")
        except ValueError:  # binascii.Error: not base64, or a length no float32 vector has
            return None
    return record


def check_resumable(path: str | os.PathLike[str], *, option: str = "output") -> None:
    """Refuse to resume from ``path`` unless it is a regular file (or does not exist yet).

    A FIFO would block the read, and a device (a link to ``/dev/zero``) never ends: neither is a
    file that a stopped run left.

    Raises:
        InvalidArgumentError: ``path`` is not a regular file (the message names it and ``resume``).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise InvalidArgumentError(f"{str(path)!r}: cannot read it to resume it ({e.strerror or e})",
                                   cli=f"{path}: cannot read it for --resume ({e.strerror or e})") from e
    if stat.S_ISREG(mode):
        return
    kind = file_kind(mode) + (f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else "")
    problem = f"is {kind}, not a regular file: there is nothing a stopped run left to continue"
    raise InvalidArgumentError(f"{str(path)!r} {problem}; drop resume=True or choose another {option}",
                               keyword="resume", cli=f"{path} {problem}; drop --resume or choose another --{option}")


def bounded_lines(path: Path, limit: int = MAX_RECORD_BYTES) -> Iterator[tuple[bytes, int]]:
    """The lines of the regular file ``path`` with the offset just after each; each read is bounded.

    Raises:
        InvalidArgumentError: ``path`` is not a regular file, or has a line longer than ``limit``.
    """
    check_resumable(path)
    offset = 0
    with open(path, "rb") as f:
        while line := f.readline(limit + 1):
            if len(line) > limit:
                problem = (f"{path} has a line of more than {limit} bytes at byte {offset}, longer than any record "
                           "convnets writes: it is damaged or another kind of file")
                raise InvalidArgumentError(f"{problem}, and resume=True cannot continue it; write to a new file",
                                           keyword="resume",
                                           cli=f"{problem}, and --resume cannot continue it; choose a new --output")
            offset += len(line)
            yield line, offset


def _limit(kind: str, width: int | None = None) -> int:
    """The longest line of a ``kind`` record (of ``width`` values per vector, when known)."""
    if kind == "predictions":
        return MAX_RECORD_BYTES
    return _MAX_EMBEDDING_LINE if width is None else MAX_RECORD_BYTES + 4 * (4 * width + 2) // 3


def _records(path: Path, kind: str, width: int | None = None) -> Iterator[tuple[Record, int, bool]]:
    """``(record, end offset, ends in a newline)`` per complete record; stops before a torn last line.

    Raises:
        InvalidArgumentError: a whole line (one that ends in a newline) that is not a record: damage.
    """
    for position, (line, end) in enumerate(bounded_lines(path, _limit(kind, width)), 1):
        record = _loads(line)
        if record is None:
            if line.endswith(b"\n"):
                raise InvalidArgumentError(f"{path}: record {position} cannot be read but is a whole line; the file "
                                           "is damaged, not just cut short: write to a new file", keyword="resume")
            return  # a killed writer's partial last line
        yield record, end, line.endswith(b"\n")


def read_spool(path: str | os.PathLike[str], kind: str = "predictions") -> Iterator[Record]:
    """The complete records of the spool (or JSONL file) ``path`` of ``kind``, in order, read lazily."""
    return (record for record, _, _ in _records(Path(path), kind))


def _width(record: Record) -> int | None:
    if "error" in record:
        return None
    return len(record["top"]) if "top" in record else len(record["embedding"])


@dataclass(frozen=True)
class ScanResult:
    """What :func:`scan` found in a spool."""

    records: int  #: complete records kept
    errors: int  #: of which records of inputs that could not be read
    end: int  #: byte offset where the complete records end (the file is cut there)
    torn: int  #: bytes of torn tail cut away
    width: int | None = None  #: classes per input or values per vector (``None``: no such record)


def scan(path: str | os.PathLike[str], *, kind: str = "predictions", width: int | None = None,
         repair: bool = True) -> ScanResult:
    """Check a spool for resuming, and cut away a torn tail.

    Args:
        path: the spool (or a JSONL file of predictions).
        kind: ``"predictions"`` or ``"embeddings"`` (the longest line accepted, the words of messages).
        width: the classes per input (``topk``) or values per vector that the resumed run writes;
            ``None``: only checked to be the same in every record.
        repair: truncate the file after its last complete record, adding the newline it may lack.

    Raises:
        InvalidArgumentError: a record of another width, damage, a line longer than any record, or
            ``path`` is not a regular file.
    """
    path = Path(path)
    records = errors = end = 0
    newline = True
    for record, end, newline in _records(path, kind, width):
        found = _width(record)
        if found is None:
            errors += 1
        elif width is None:
            width = found
        elif found != width:
            unit, keyword, cli = _WIDTH_WORDS[kind]
            raise InvalidArgumentError(f"{path} holds {found} {unit}, this run {width}: resume with the same "
                                       f"{keyword}", keyword=keyword,
                                       cli=f"{path} holds {found} {unit}, this run {width}: resume with the same {cli}")
        records += 1
    size = path.stat().st_size
    if repair and size > end:
        log.warning("%s: cutting a torn tail of %d bytes after record %d", path, size - end, records)
    if repair and (size > end or not newline):
        with open(path, "r+b") as f:
            f.truncate(end)
            if not newline:  # a complete last record that lost only its newline: later records start a line
                log.warning("%s: adding the newline its last record lacks", path)
                f.seek(end)
                f.write(b"\n")
                end += 1
            os.fsync(f.fileno())
    return ScanResult(records=records, errors=errors, end=end, torn=max(size - end, 0), width=width)


class SpoolWriter:
    """Appends records to a text stream as JSON lines, :meth:`flush` after each batch: one write per
    batch, so a killed process leaves whole batches plus at most one torn line.

    Args:
        stream: the spool open for appending (:func:`open_spool`), or standard output (``predict --jsonl``).
    """

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._pending: list[str] = []

    def write(self, record: Record) -> None:
        """Queue one record; it reaches the stream at the next :meth:`flush`."""
        self._pending.append(dumps(record) + "\n")

    def flush(self) -> None:
        """Write the queued records and flush them to the operating system; a full disk's error names the file."""
        text, self._pending = "".join(self._pending), []
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError as e:
            raise naming(e, getattr(self.stream, "name", "<stream>")) from e

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Flush what is queued and close the file, also after an error (the records written stay, for
        ``--resume``); then a failure of its own (a full disk, again) is not raised in that error's place."""
        try:
            self.flush()
            self.stream.close()
        except OSError as e:
            with contextlib.suppress(OSError):
                self.stream.close()
            if kind is None:
                raise naming(e, self.stream.name) if e.filename is None else e from None


def open_spool(path: Path, *, append: bool) -> SpoolWriter:
    """A writer appending to the spool ``path``, or to a new one (refused if it exists); use it as a
    context manager."""
    return SpoolWriter(open(path, "a" if append else "x", encoding="utf-8", newline=""))


def write_spool(path: str | os.PathLike[str], records: Iterable[Record]) -> int:
    """Write a whole spool from ``records`` atomically (``path`` appears complete, or not at all); returns the count."""
    count = 0
    with atomic_output(path) as f:
        for chunk in batched(records, 1024):
            f.write("".join(dumps(record) + "\n" for record in chunk).encode("utf-8"))
            count += len(chunk)
    return count


def batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in lists of ``size`` (the last one shorter)."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
