"""``.parquet`` (needs pyarrow), one row group per batch: ``input``, ``top`` (list of ``{index, label,
probability}``) and ``error`` (a multi-label model's: also ``labels``, the list of classes above their
thresholds), or ``input`` and ``embedding`` (fixed-size float32 list; failed inputs have no row).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from convnets.errors import MissingDependencyError
from convnets.inputs.names import decode_name, encode_name, safe_text
from convnets.inference.outputs.base import OutputFormat
from convnets.inference.outputs.spool import Record, batched, read_spool

__all__ = ["FORMAT", "Parquet", "import_pyarrow"]


class Parquet(OutputFormat):
    name = "parquet"
    suffixes = (".parquet",)
    holds = {"predictions": "input, top, error; needs pyarrow",
             "embeddings": "input, embedding; needs pyarrow"}
    readable = frozenset({"predictions"})

    def check(self) -> None:
        import_pyarrow()

    def write(self, path: Path, spool: Path, *, kind: str, width: int, batch_size: int) -> int:
        from convnets.fileio import atomic_output

        pa, pq = import_pyarrow()
        if kind == "predictions":
            top = pa.struct([("index", pa.int32()), ("label", pa.string()), ("probability", pa.float64())])
            columns = [("input", pa.string()), ("top", pa.list_(top)), ("error", pa.string())]
            if any("labels" in r for r in itertools.islice((r for r in read_spool(spool) if "top" in r), 1)):
                columns.append(("labels", pa.list_(pa.string())))  # a multi-label model
            schema = pa.schema(columns)
        else:
            schema = pa.schema([("input", pa.string()), ("embedding", pa.list_(pa.float32(), width))])
        count = 0
        with atomic_output(path) as f, pq.ParquetWriter(f, schema) as parquet:
            for batch in batched(read_spool(spool, kind), batch_size):
                table = _predictions(pa, batch, schema) if kind == "predictions" else _embeddings(pa, batch, schema)
                if table.num_rows:
                    parquet.write_table(table)
                count += table.num_rows
        return count

    def read(self, path: Path, kind: str) -> Iterator[Record]:
        _, pq = import_pyarrow()
        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():  # the unused one of top and error is null
                found = {key: value for key, value in row.items() if value is not None}
                found["input"] = decode_name(found["input"])
                yield found


def _predictions(pa: Any, records: list[Record], schema: Any) -> Any:
    return pa.Table.from_pylist([{"input": encode_name(r["input"]), "top": r.get("top"),
                                  "error": None if r.get("error") is None else safe_text(r["error"]),
                                  "labels": r.get("labels")}
                                 for r in records], schema=schema)


def _embeddings(pa: Any, records: list[Record], schema: Any) -> Any:
    import numpy as np

    rows = [r for r in records if "error" not in r]
    values = pa.array(np.concatenate([r["embedding"] for r in rows]) if rows else np.zeros(0, "<f4"), type=pa.float32())
    return pa.table({"input": pa.array([encode_name(r["input"]) for r in rows], type=pa.string()),
                     "embedding": pa.FixedSizeListArray.from_arrays(values, schema.field("embedding").type.list_size)},
                    schema=schema)


def import_pyarrow() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, or an error that names the extra to install."""
    from convnets.extras import install_hint

    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingDependencyError(f"writing .parquet files needs pyarrow, which cannot be imported ({e}); "
                                     f"install the 'parquet' extra: {install_hint('parquet')}") from e
    return pa, pq


FORMAT = Parquet()
