"""Prediction records on disk: streaming writers for JSONL, CSV and Parquet, and crash-safe resume.

A record is the result for one input, as ``convnets predict`` writes it::

    {"input": "a.jpg", "top": [{"index": 3, "label": "cat", "probability": 0.91}, ...]}
    {"input": "b.jpg", "error": "Cannot decode ..."}

Formats (picked by the file's suffix, :data:`FORMATS`):

* ``.jsonl``: one record per line.
* ``.csv``: columns ``input, rank, index, label, probability, error``; one row per top-k entry
  (ranks 1..k), or one row with ``error`` filled for an input that could not be read.
* ``.parquet``: columns ``input`` (string), ``top`` (list of ``{index, label, probability}``, null
  for a failed input) and ``error`` (string, null for a classified one); one row group per batch.
  Needs pyarrow (``pip install 'convnets-hub[parquet]'``).

Input names are bytes-safe (a name that is not UTF-8, or holds a line break, is one record like
any other): JSONL writes undecodable bytes as ``\\udcXX`` escapes, CSV and Parquet write such names
as JSON string literals; :mod:`convnets.inference.names` describes the scheme, which the readers
here (and ``--resume``) reverse.

Writers append records and :meth:`RecordWriter.flush` them to the operating system after each batch,
so a killed process loses at most the batch in flight. Resuming (JSONL and CSV only) reads the file
back with :func:`scan`: complete records are kept, a torn tail (the partial last line of a killed
writer, or a CSV record with fewer than k rows) is cut away, and the recorded inputs are handed back
in order so that the caller can skip exactly them. A Parquet file is only complete once its footer
is written at the end, so it is written to a temporary file renamed into place at the end of the
run (a killed run leaves no ``FILE``), and cannot be resumed.

Every format also has a reader, :func:`read_records` (a complete file's records, lazily), and
:func:`write_records` writes a whole file atomically a batch at a time, byte for byte as a run
would: :mod:`convnets.inference.shard` merges and splits the parts of a sharded run with these two.

Embeddings (``convnets embed``: ``.npy`` and ``.parquet``) stream into a resumable spool and are
assembled at the end: :mod:`convnets.inference.spool`, which shares this module's helpers
(:func:`suffix_format`, :func:`cut_tail`, :func:`write_batches`, :func:`import_pyarrow`).

This module imports neither PyTorch nor pyarrow until a Parquet file is written or read.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from convnets.errors import InvalidArgumentError, MissingDependencyError, short_repr
from convnets.inference.names import decode_name, encode_name, escape_json, safe_text

__all__ = ["CSV_COLUMNS", "FORMATS", "MAX_RECORD_BYTES", "RESUMABLE_FORMATS", "Record", "RecordWriter", "ScanResult",
           "Writer", "check_destination", "check_resumable", "cut_tail", "format_of", "import_pyarrow", "open_writer",
           "read_records", "recorded_inputs", "recorded_topk", "scan", "suffix_format", "write_batches",
           "write_records"]

log = logging.getLogger(__name__)

#: Output formats by file suffix.
FORMATS: dict[str, str] = {".jsonl": "jsonl", ".csv": "csv", ".parquet": "parquet"}
#: Formats that ``resume`` can continue.
RESUMABLE_FORMATS = frozenset({"jsonl", "csv"})
#: The CSV header.
CSV_COLUMNS = ("input", "rank", "index", "label", "probability", "error")
#: The longest line (a JSONL record, a CSV row) that reading a file back accepts: a record of top
#: 1000 classes with 4 KB labels, or a name of a megabyte, still fits; a longer line is damage or
#: another kind of file, and reading it whole could take any amount of memory.
MAX_RECORD_BYTES = 4 << 20

Record = dict[str, Any]


class Writer(Protocol):
    """What a run writes records through: this module's :class:`RecordWriter`, the embeddings'
    :class:`~convnets.inference.spool.EmbeddingWriter`."""

    def write(self, record: Record) -> None: ...

    def flush(self) -> None: ...


def suffix_format(path: str | os.PathLike[str], formats: dict[str, str], *, option: str = "output",
                  kind: str = "format") -> str:
    """The format that ``path``'s suffix names in ``formats``.

    Args:
        path: the file.
        formats: suffix -> format name.
        option: the interface's name of ``path`` in messages (``--option`` on the command line).
        kind: what the message calls the format (``"embedding format"``).

    Raises:
        InvalidArgumentError: an unknown suffix.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in formats:
        problem = f"unknown {kind} {suffix or '(no suffix)'!r}; end the file name in {', '.join(formats)}"
        raise InvalidArgumentError(f"{option}={str(path)!r}: {problem}", cli=f"--{option} {path}: {problem}")
    return formats[suffix]


def format_of(path: str | os.PathLike[str], *, option: str = "output") -> str:
    """The prediction format that ``path``'s suffix names (:data:`FORMATS`; see :func:`suffix_format`)."""
    return suffix_format(path, FORMATS, option=option)


def _csv_rows(record: Record) -> list[list[object]]:
    name = encode_name(record["input"])
    if "error" in record:
        return [[name, "", "", "", "", safe_text(record["error"])]]
    return [[name, rank, t["index"], t["label"], repr(t["probability"]), ""]
            for rank, t in enumerate(record["top"], 1)]


class RecordWriter:
    """Appends records to a stream in one format; :meth:`flush` after each batch.

    Args:
        stream: a text stream (JSONL, CSV) or a binary one (Parquet).
        fmt: ``"jsonl"``, ``"csv"`` or ``"parquet"``.
        header: write the CSV header first (a new file).
    """

    def __init__(self, stream: IO[Any], fmt: str, *, header: bool = False) -> None:
        self.stream, self.format = stream, fmt
        self._pending: list[Record] = []
        self._parquet: Any = None
        if header and fmt == "csv":
            self._emit(",".join(CSV_COLUMNS) + "\n")

    def write(self, record: Record) -> None:
        """Queue one record; it reaches the stream at the next :meth:`flush`."""
        self._pending.append(record)

    def flush(self) -> None:
        """Write the queued records (one Parquet row group) and flush them to the operating system."""
        records, self._pending = self._pending, []
        if not records:
            return
        if self.format == "parquet":
            self._write_parquet(records)
            return
        # One write per batch: a killed process leaves whole batches plus at most one torn tail.
        buffer = io.StringIO()
        if self.format == "jsonl":
            buffer.writelines(escape_json(json.dumps(r, ensure_ascii=False)) + "\n" for r in records)
        else:
            csv.writer(buffer, lineterminator="\n").writerows(row for r in records for row in _csv_rows(r))
        self._emit(buffer.getvalue())

    def _emit(self, text: str) -> None:
        """Write ``text`` and flush it; a full disk's error names the file (a write names none)."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError as e:
            from convnets.fileio import naming

            raise naming(e, getattr(self.stream, "name", "<stream>")) from e

    def _write_parquet(self, records: list[Record]) -> None:
        pa, pq = import_pyarrow()
        if self._parquet is None:
            self._parquet = pq.ParquetWriter(self.stream, _parquet_schema(pa))
        table = pa.Table.from_pylist([{"input": encode_name(r["input"]), "top": r.get("top"),
                                       "error": None if r.get("error") is None else safe_text(r["error"])}
                                      for r in records], schema=self._parquet.schema)
        self._parquet.write_table(table)

    def close(self) -> None:
        """Flush what is queued and finish the file (the Parquet footer); the stream stays open."""
        self.flush()
        if self.format == "parquet":
            pa, pq = import_pyarrow()
            if self._parquet is None:  # no record at all: still a valid, empty file
                self._parquet = pq.ParquetWriter(self.stream, _parquet_schema(pa))
            self._parquet.close()


def import_pyarrow() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, or an error that names the extra to install."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingDependencyError(f"writing .parquet files needs pyarrow, which cannot be imported ({e}); "
                                     "install the 'parquet' extra: pip install 'convnets-hub[parquet]'") from e
    return pa, pq


def _parquet_schema(pa: Any) -> Any:
    top = pa.struct([("index", pa.int32()), ("label", pa.string()), ("probability", pa.float64())])
    return pa.schema([("input", pa.string()), ("top", pa.list_(top)), ("error", pa.string())])


@dataclass(frozen=True)
class ScanResult:
    """What :func:`scan` found in an existing file."""

    records: int  #: complete records kept
    errors: int  #: of which records of inputs that could not be read
    end: int  #: byte offset where the complete records end (the file is cut there)
    torn: int  #: bytes of torn tail cut away


def check_resumable(path: str | os.PathLike[str], *, option: str = "output") -> None:
    """Refuse to resume ``path`` unless it is a regular file (or does not exist yet).

    A FIFO would block the scan, and a device (a link to ``/dev/zero``) never ends: neither is a
    file that a stopped run left.

    Raises:
        InvalidArgumentError: ``path`` is not a regular file (the message names it and ``resume``).
    """
    from convnets.fileio import file_kind

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


def _too_long(path: Path, offset: int) -> InvalidArgumentError:
    problem = (f"{path} has a line of more than {MAX_RECORD_BYTES} bytes at byte {offset}, longer than any record "
               "convnets writes: it is damaged or another kind of file")
    return InvalidArgumentError(f"{problem}, and resume=True cannot continue it; write to a new file",
                                keyword="resume", cli=f"{problem}, and --resume cannot continue it; choose a new --output")


def _binary_lines(f: IO[bytes], path: Path) -> Iterator[tuple[bytes, int]]:
    """Lines of a binary file with the offset just after each; each read is bounded.

    Raises:
        InvalidArgumentError: a line longer than :data:`MAX_RECORD_BYTES`.
    """
    offset = 0
    while line := f.readline(MAX_RECORD_BYTES + 1):
        if len(line) > MAX_RECORD_BYTES:
            raise _too_long(path, offset)
        offset += len(line)
        yield line, offset


def _iter_jsonl(path: Path) -> Iterator[tuple[Record | None, int]]:
    """``(record, end offset)`` per line; ``None`` for a torn or unreadable line.

    A last line without its newline is a record when it is a whole JSON object (one that lost only
    its newline, e.g. written by another tool or copied with an editor); a torn line, cut inside
    the object, cannot parse as one.
    """
    with open(path, "rb") as f:
        for line, end in _binary_lines(f, path):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            yield (record if isinstance(record, dict) and "input" in record else None), end


def _iter_csv_rows(path: Path) -> Iterator[tuple[list[str] | None, int]]:
    """``(row, end offset)`` per CSV row (quoted newlines included); ``None`` for a torn last row."""
    with open(path, "rb") as f:
        lines = _binary_lines(f, path)
        offset = [0]
        complete = [True]

        def text() -> Iterator[str]:
            for line, end in lines:
                offset[0] = end
                complete[0] = line.endswith(b"\n")
                yield line.decode("utf-8", errors="replace")
        reader = csv.reader(text())
        try:
            for row in reader:
                yield (row if complete[0] else None), offset[0]
        except csv.Error:  # an unterminated quoted field at the end of the file
            yield None, offset[0]


def _csv_records(path: Path, topk: int) -> Iterator[tuple[Record | None, int]]:
    """Rows grouped into records: ``(record, end offset)``; ``None`` for an incomplete or bad one.

    A record starts at rank 1 or at an error row; one with a rank 1 row must have ``topk`` rows.
    """
    rows = _iter_csv_rows(path)
    header, _ = next(rows, (None, 0))
    if header is not None and tuple(header) != CSV_COLUMNS:
        raise InvalidArgumentError(f"{path} is not a convnets predict CSV file (its header is {short_repr(header)})")
    group: list[list[str]] = []
    group_end = 0

    def finish() -> tuple[Record | None, int]:
        first = group[0]
        name = decode_name(first[0])
        if first[5]:
            return ({"input": name, "error": first[5]} if len(group) == 1 else None), group_end
        # Ranks 1..m of one input (m is checked against topk by scan: only the last record may be short).
        ok = [r[1] for r in group] == [str(i) for i in range(1, len(group) + 1)] and all(r[0] == first[0] for r in group)
        return ({"input": name, "top": [{"index": int(r[2]), "label": r[3], "probability": float(r[4])}
                                            for r in group]} if ok else None), group_end
    for row, end in rows:
        if row is None or len(row) != len(CSV_COLUMNS):
            if group:
                yield finish()
                group = []
            yield None, end
            continue
        if group and (row[5] or row[1] == "1"):
            yield finish()
            group = []
        group.append(row)
        group_end = end
    if group:
        yield finish()


def _records(path: Path, fmt: str, topk: int) -> Iterator[tuple[Record | None, int]]:
    return _iter_jsonl(path) if fmt == "jsonl" else _csv_records(path, topk)


def _records_after(path: Path, fmt: str, topk: int, position: int) -> Iterator[Record]:
    """The readable records after the ``position``-th (1-based) one."""
    for i, (record, _) in enumerate(_records(path, fmt, topk), 1):
        if i > position and record is not None:
            yield record


def scan(path: str | os.PathLike[str], *, topk: int, repair: bool = True) -> ScanResult:
    """Check an existing output file for resuming, and cut away a torn tail.

    Args:
        path: a ``.jsonl`` or ``.csv`` file written by :class:`RecordWriter`.
        topk: classes per record that the resumed run writes (a classified CSV record is complete
            with this many rows; a file written with another k is refused).
        repair: truncate the file after its last complete record.

    Returns:
        The count of complete records and where they end.

    Raises:
        InvalidArgumentError: an unreadable record before the last one, records with another k, a line
            longer than :data:`MAX_RECORD_BYTES`, or ``path`` is not a regular file.
    """
    path = Path(path)
    fmt = format_of(path)
    check_resumable(path)
    records = errors = end = 0
    last: tuple[Record, int] | None = None  # checked when the next one arrives: only the last may be torn

    def keep(record: Record, record_end: int) -> None:
        nonlocal records, errors, end
        if "error" in record:
            errors += 1
        elif len(record["top"]) != topk:
            raise InvalidArgumentError(f"{path} holds {len(record['top'])} classes per input, this run "
                                       f"{topk}: resume with the same topk", keyword="topk",
                                       cli=f"{path} holds {len(record['top'])} classes per input, this run "
                                           f"{topk}: resume with the same --topk")
        records += 1
        end = record_end
    def short(record: Record) -> bool:
        # A CSV record short of rows, just before the end or a torn row, is part of a killed writer's tail.
        return fmt == "csv" and "top" in record and len(record["top"]) < topk
    for position, (record, record_end) in enumerate(_records(path, fmt, topk), 1):
        if record is None:  # torn: must be the end of the file
            if next(_records_after(path, fmt, topk, position), None) is not None:
                raise InvalidArgumentError(f"{path}: record {position} cannot be read but later ones can; the "
                                           "file is damaged, not just cut short: write to a new file")
            break
        if last is not None:
            keep(*last)
        last = (record, record_end)
    if last is not None and not short(last[0]):
        keep(*last)
    if fmt == "csv" and end == 0:  # no complete record: keep the header if it is whole
        header = (",".join(CSV_COLUMNS) + "\n").encode()
        with open(path, "rb") as f:
            end = len(header) if f.read(len(header)) == header else 0
    size = path.stat().st_size
    # A killed writer leaves at most one partial line (JSONL), or a record short of rows and one
    # partial row (CSV): a longer unreadable tail is damage (e.g. an unclosed quote), never cut away.
    if _newlines_after(path, end, limit=topk) > (topk - 1 if fmt == "csv" else 0):
        raise InvalidArgumentError(f"{path}: the {size - end} bytes after record {records} cannot be read and are "
                                   "more than a stopped run leaves; the file is damaged: write to a new file")
    if repair:
        cut_tail(path, end, records)
        if fmt == "jsonl" and end > 0:
            end += _end_line(path, end)
    return ScanResult(records=records, errors=errors, end=end, torn=max(size - end, 0))


def _end_line(path: Path, end: int) -> int:
    """Add the newline a complete last record lacks (so that appended records start a line); returns 0 or 1."""
    with open(path, "r+b") as f:
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return 0
        log.warning("%s: adding the newline its last record lacks", path)
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
        return 1


def cut_tail(path: Path, end: int, records: int) -> None:
    """Truncate ``path`` after its ``records`` complete records (which end at byte ``end``), durably."""
    size = path.stat().st_size
    if size > end:
        log.warning("%s: cutting a torn tail of %d bytes after record %d", path, size - end, records)
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())


def _newlines_after(path: Path, offset: int, *, limit: int) -> int:
    """How many line ends ``path`` has after ``offset`` (counting stops above ``limit``)."""
    count = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while count <= limit and (chunk := f.read(1 << 16)):
            count += chunk.count(b"\n")
    return count


def recorded_topk(path: str | os.PathLike[str]) -> int | None:
    """Classes per input in the first classified record of ``path`` (``None``: none is readable)."""
    path = Path(path)
    for record, _ in _records(path, format_of(path), 0):  # topk is not needed to group rows
        if record is not None and "top" in record:
            return len(record["top"])
    return None


def recorded_inputs(path: str | os.PathLike[str], *, topk: int) -> Iterator[str]:
    """The inputs of the complete records of ``path``, in order (read lazily: constant memory)."""
    path = Path(path)
    for record, _ in _records(path, format_of(path), topk):
        if record is None:
            return
        yield record["input"]


def check_destination(path: str | os.PathLike[str], *, resume: bool, option: str = "output") -> str:
    """Check, before any work, that records can go to ``path``; returns its format.

    Raises:
        InvalidArgumentError: unknown suffix; ``path`` exists and ``resume`` is off; ``resume`` with Parquet,
            or of a path that is not a regular file.
        MissingDependencyError: Parquet without pyarrow.
    """
    path = Path(path)
    fmt = format_of(path, option=option)
    if resume and fmt not in RESUMABLE_FORMATS:
        raise InvalidArgumentError(
            f"resume=True works with .jsonl and .csv outputs, not {path.suffix}: a Parquet file is only readable "
            "once complete; write .jsonl and convert it, or drop resume", keyword="resume",
            cli=f"--resume works with .jsonl and .csv outputs, not {path.suffix}: a Parquet file is only readable "
                f"once complete; write .jsonl and convert it, or drop --resume")
    if resume:
        check_resumable(path, option=option)
    if path.exists() and not resume:
        raise InvalidArgumentError(f"{option}={str(path)!r} exists; pass resume=True to continue it, or choose "
                                   "another file", keyword="resume",
                                   cli=f"--{option} {path} exists; pass --resume to continue it, or remove it "
                                       "or choose another file")
    if fmt == "parquet":
        import_pyarrow()
    return fmt


def open_writer(path: str | os.PathLike[str], *, resume: bool, topk: int, stack: ExitStack,
                option: str = "output") -> tuple[RecordWriter, ScanResult | None]:
    """Open ``path`` for writing records, or for appending to it with ``resume``.

    Args:
        path: the output file; its suffix picks the format (:func:`format_of`).
        resume: continue an existing JSONL or CSV file (after :func:`scan`); a missing file starts anew.
        topk: classes per record (checked against the file's when resuming).
        stack: closes the file (and, for Parquet, renames it into place) when it unwinds without error.
        option: the interface's name of ``path`` in messages (``--output`` on the command line).

    Returns:
        The writer and, when an existing file is resumed, what :func:`scan` found in it.

    Raises:
        InvalidArgumentError: unknown suffix; ``path`` exists and ``resume`` is off; ``resume`` with Parquet.
        MissingDependencyError: Parquet without pyarrow.
    """
    path = Path(path)
    fmt = check_destination(path, resume=resume, option=option)
    if fmt == "parquet":
        from convnets.fileio import atomic_output

        writer = RecordWriter(stack.enter_context(atomic_output(path)), fmt)
        stack.callback(writer.close)  # runs before atomic_output commits (the stack is last-in first-out)
        return writer, None
    found = scan(path, topk=topk) if resume and path.exists() else None
    stream = open(path, "a" if found else "x", encoding="utf-8", newline="")
    stack.push(_closer(stream, path))
    writer = RecordWriter(stream, fmt, header=fmt == "csv" and (found is None or found.end == 0))
    stack.callback(writer.flush)
    return writer, found


def _closer(stream: IO[Any], path: Path) -> Callable[..., bool]:
    """An exit callback that closes ``stream``, the file ``path``: a failure names the file, and after
    an error (the disk full) the close's own failure (flushing the same bytes again) is not raised in
    its place."""
    def close(kind: type[BaseException] | None, *_: object) -> bool:
        try:
            stream.close()
        except OSError as e:
            if kind is None:
                from convnets.fileio import naming

                raise naming(e, path) from e
        return False
    return close


def read_records(path: str | os.PathLike[str], fmt: str | None = None) -> Iterator[Record]:
    """The records of a complete file, in order, read lazily (the inverse of :func:`write_records`).

    Args:
        path: a file written by :class:`RecordWriter`.
        fmt: its format (:data:`FORMATS`' values); default: from its suffix.

    Yields:
        Records as written: ``{"input", "top"}`` or ``{"input", "error"}``.

    Raises:
        InvalidArgumentError: a record cannot be read (a torn or damaged file: :func:`scan` repairs
            what a killed writer leaves).
    """
    path = Path(path)
    fmt = fmt or format_of(path)
    if fmt == "parquet":
        _, pq = import_pyarrow()
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():  # columns input, top, error: the unused one of the last two is null
                found = {key: value for key, value in row.items() if value is not None}
                found["input"] = decode_name(found["input"])
                yield found
        return
    for position, (record, _) in enumerate(_records(path, fmt, 0), 1):
        if record is None:
            raise InvalidArgumentError(f"{path}: record {position} cannot be read; the file is torn or damaged")
        yield record


def write_records(path: str | os.PathLike[str], batches: Iterable[Iterable[Record]], fmt: str | None = None) -> int:
    """Write a new file of records atomically (``path`` appears complete, or not at all), a batch at a time.

    Each batch is flushed as a run writes it (a Parquet row group per batch), so the file is the one
    that a run with these batches writes, byte for byte.

    Args:
        path: the file to write; an existing one is replaced.
        batches: the records, batch by batch.
        fmt: the format (:data:`FORMATS`' values); default: from ``path``'s suffix.

    Returns:
        The number of records written.
    """
    from convnets.fileio import atomic_output

    path = Path(path)
    fmt = fmt or format_of(path)
    with atomic_output(path) as raw:
        stream: IO[Any] = raw if fmt == "parquet" else io.TextIOWrapper(raw, encoding="utf-8", newline="")
        writer = RecordWriter(stream, fmt, header=fmt == "csv")
        count = write_batches(writer, batches)
        writer.close()
        if isinstance(stream, io.TextIOWrapper):
            stream.detach()  # flushed; atomic_output closes the file itself
    return count


def write_batches(writer: Writer, batches: Iterable[Iterable[Record]]) -> int:
    """Write ``batches`` through ``writer``, one flush per batch (as a run writes them); returns the count."""
    count = 0
    for batch in batches:
        for record in batch:
            writer.write(record)
            count += 1
        writer.flush()
    return count
