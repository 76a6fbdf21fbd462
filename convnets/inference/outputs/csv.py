"""``.csv``: ``input, rank, index, label, probability, error``; a row per top-k class, or one with ``error``.
A multi-label model's file has a last column more, ``labels``: on each of an input's rows, the classes above
their thresholds, separated by ``;`` (as in the labels CSV of training).

Every text field is quoted (:data:`csv.QUOTE_NONNUMERIC`; the numbers are not), so a class name from a
checkpoint that holds a line break (``\\r`` too, which the csv module does not quote otherwise) or a comma
stays one field of one record for any CSV reader.
"""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Iterator
from pathlib import Path

from convnets.data.multilabel import LABEL_SEPARATOR
from convnets.errors import InvalidArgumentError
from convnets.inputs.names import decode_name, encode_name, safe_text
from convnets.inference.outputs.base import OutputFormat
from convnets.inference.outputs.spool import Record, batched, bounded_lines, read_spool

__all__ = ["COLUMNS", "FORMAT", "Csv"]

COLUMNS = ("input", "rank", "index", "label", "probability", "error")
#: The columns of a multi-label model's predictions.
MULTILABEL_COLUMNS = (*COLUMNS, "labels")


class Csv(OutputFormat):
    name = "csv"
    suffixes = (".csv",)
    holds = {"predictions": "input, rank, index, label, probability, error (multi-label: and labels): a row per class"}
    readable = frozenset({"predictions"})

    def write(self, path: Path, spool: Path, *, kind: str, width: int, batch_size: int) -> int:
        from convnets.fileio import atomic_output

        count = 0
        with atomic_output(path) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
            rows = csv.writer(text, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
            multilabel = any("labels" in r for r in itertools.islice((r for r in read_spool(spool) if "top" in r), 1))
            rows.writerow(MULTILABEL_COLUMNS if multilabel else COLUMNS)
            for chunk in batched(read_spool(spool), 1024):
                rows.writerows(row for record in chunk for row in _rows(record, multilabel))
                count += len(chunk)
            text.flush()
            text.detach()  # atomic_output closes the file itself
        return count

    def read(self, path: Path, kind: str) -> Iterator[Record]:
        rows = csv.reader(line.decode("utf-8", errors="replace") for line, _ in bounded_lines(path))
        header = tuple(next(rows, COLUMNS))
        if header not in (COLUMNS, MULTILABEL_COLUMNS):
            raise InvalidArgumentError(f"{path} is not a convnets predict CSV file (its header is not "
                                       f"{','.join(COLUMNS)}[,labels])")
        record: Record | None = None
        try:
            for row in rows:
                name, rank, index, label, probability, error = row[:6]
                if len(row) != len(header):
                    raise ValueError(f"row {row!r} has {len(row)} fields, not {len(header)}")
                if error and not rank:
                    new: Record = {"input": decode_name(name), "error": error}
                elif rank == "1":
                    new = {"input": decode_name(name), "top": []}
                    if len(header) > len(COLUMNS):
                        new["labels"] = [n for n in row[6].split(LABEL_SEPARATOR) if n]
                elif record is not None and "top" in record and decode_name(name) == record["input"] \
                        and rank == str(len(record["top"]) + 1):
                    new = record
                else:
                    raise ValueError(f"row {row!r} does not continue the record before it")
                if "top" in new:
                    new["top"].append({"index": int(index), "label": label, "probability": float(probability)})
                if new is not record:
                    if record is not None:
                        yield record
                    record = new
        except (ValueError, csv.Error) as e:
            raise InvalidArgumentError(f"{path}: line {rows.line_num} is not what convnets predict writes ({e}); "
                                       "the file is damaged: write to a new file", keyword="resume") from None
        if record is not None:
            yield record

def _rows(record: Record, multilabel: bool = False) -> list[list[object]]:
    name = encode_name(record["input"])
    more: list[object] = [LABEL_SEPARATOR.join(record.get("labels", []))] if multilabel else []
    if "error" in record:
        return [[name, "", "", "", "", safe_text(record["error"]), *([""] if multilabel else [])]]
    return [[name, rank, t["index"], t["label"], float(t["probability"]), "", *more]
            for rank, t in enumerate(record["top"], 1)]


FORMAT = Csv()
