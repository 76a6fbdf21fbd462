"""The spool: the one append-only, resumable file (``FILE.partial.jsonl``) that a batch run writes as it runs.

One JSON line per input, one write per batch: ``{"input", "top"}``, ``{"input", "embedding"}`` (base64 of
the little-endian float32 bytes) or ``{"input", "error"}``. :func:`scan` cuts a killed writer's torn last
line away and refuses anything else unreadable.
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
from convnets.fileio import atomic_output, naming
from convnets.paths import file_kind
from convnets.inputs.names import escape_json
from convnets.models.specs import MAX_CHANNELS, MAX_EXPANSION

__all__ = ["MAX_RECORD_BYTES", "Record", "ScanResult", "SpoolWriter", "batched", "check_resumable", "dumps",
           "open_spool", "read_spool", "scan", "spool_path", "write_spool"]

log = logging.getLogger(__name__)

Record = dict[str, Any]
T = TypeVar("T")

#: The longest prediction line read back (top 1000 classes with 4 KB labels fit): a longer one is damage, and
#: reading it whole could take any amount of memory. An embedding line may add the widest vector a model gives.
MAX_RECORD_BYTES = 4 << 20

#: Per kind: the unit of a record's width, and the option that sets it (keyword, command line).
_WIDTH_WORDS = {"predictions": ("classes per input", "topk", "--topk"),
                "embeddings": ("values per vector", "layer", "--layer and model")}


def spool_path(output: str | os.PathLike[str]) -> Path:
    """The spool of ``output``: ``FILE.partial.jsonl``."""
    path = Path(output)
    return path.with_name(f"{path.name}.partial.jsonl")


def dumps(record: Record) -> str:
    """One record as its line, without the newline."""
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
    """Refuse to resume from ``path`` unless it is a regular file or missing (a FIFO blocks, a device never ends)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return
        kind = f"a link to {os.path.realpath(path)}, which does not exist"  # nothing to resume, nor to create
    except OSError as e:
        raise InvalidArgumentError(f"{str(path)!r}: cannot read it to resume it ({e.strerror or e})",
                                   cli=f"{path}: cannot read it for --resume ({e.strerror or e})") from e
    else:
        if stat.S_ISREG(mode):
            return
        kind = file_kind(mode) + (f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else "")
    problem = f"is {kind}, not a regular file: there is nothing a stopped run left to continue"
    raise InvalidArgumentError(f"{str(path)!r} {problem}; drop resume=True or choose another {option}",
                               keyword="resume", cli=f"{path} {problem}; drop --resume or choose another --{option}")


def bounded_lines(path: Path, limit: int = MAX_RECORD_BYTES) -> Iterator[tuple[bytes, int]]:
    """The lines of the regular file ``path``, each with the offset after it; a line over ``limit`` is refused."""
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
    """The longest line of a ``kind`` record (of ``width`` values per vector; default: the widest)."""
    if kind == "predictions":
        return MAX_RECORD_BYTES
    values = MAX_CHANNELS * MAX_EXPANSION if width is None else width
    return MAX_RECORD_BYTES + 4 * (4 * values + 2) // 3  # base64 of float32


def _records(path: Path, kind: str, width: int | None = None) -> Iterator[tuple[Record, int, bool]]:
    """``(record, end offset, ends in a newline)`` per complete record; stops before a torn last line, refuses
    a whole line that is not a record (damage)."""
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
    """What :func:`scan` found: complete records, of which errors, their end offset, torn bytes cut, width."""

    records: int
    errors: int
    end: int
    torn: int
    width: int | None = None


def scan(path: str | os.PathLike[str], *, kind: str = "predictions", width: int | None = None,
         repair: bool = True) -> ScanResult:
    """Check a spool for resuming: every record of ``width`` values (``None``: of one width); with ``repair``,
    truncate it after the last complete record, adding the newline that record may lack."""
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
    """Appends records to ``stream`` as JSON lines, one write per :meth:`flush` (a killed process leaves whole
    batches and at most one torn line)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self._pending: list[str] = []

    def write(self, record: Record) -> None:
        """Queue one record; it reaches the stream at the next :meth:`flush`."""
        self._pending.append(dumps(record) + "\n")

    def flush(self) -> None:
        """Write the queued records and flush them to the operating system; an error names the file."""
        text, self._pending = "".join(self._pending), []
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError as e:
            raise naming(e, getattr(self.stream, "name", "<stream>")) from e

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Flush and close, also after an error (whose place a failure of its own does not take)."""
        try:
            self.flush()
            self.stream.close()
        except OSError as e:
            with contextlib.suppress(OSError):
                self.stream.close()
            if kind is None:
                raise naming(e, self.stream.name) if e.filename is None else e from None


def open_spool(path: Path, *, append: bool) -> SpoolWriter:
    """A writer appending to the spool ``path``, or creating it (refused if it exists)."""
    return SpoolWriter(open(path, "a" if append else "x", encoding="utf-8", newline=""))


def write_spool(path: str | os.PathLike[str], records: Iterable[Record]) -> int:
    """Write a whole spool from ``records`` atomically; returns the count."""
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
