"""What a run reports: ``metrics.jsonl`` (one JSON line per epoch) and :class:`TrainSummary`.

``metrics.jsonl`` is appended after each epoch's checkpoint and rewritten from the checkpoint's
history on ``--resume``, so it always describes the epochs that the checkpoint holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convnets.errors import DataError
from convnets.fileio import atomic_write

__all__ = ["METRICS", "TrainSummary", "append_metrics", "format_rate", "read_metrics", "write_history"]

#: File name of the per-epoch metrics in the output directory.
METRICS = "metrics.jsonl"


def format_rate(rate: float) -> str:
    """A rate for people: whole numbers from 1 up, two significant digits below (0.37, not 0)."""
    return f"{rate:.0f}" if rate >= 1 else f"{rate:.2g}"


def write_history(path: Path, history: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` from a checkpoint's history (on resume, drops later epochs)."""
    text = "".join(json.dumps(r) + "\n" for r in history)
    atomic_write(path, lambda f: f.write(text.encode()))


def append_metrics(path: Path, record: Mapping[str, Any]) -> None:
    """Append one epoch's record, on disk before returning (never through a symbolic link)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with open(os.open(path, flags, 0o666), "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order.

    A last line without its newline is being appended by a running ``convnets train`` (or was cut
    by a crash) and is left out.

    Raises:
        DataError: a complete line is not a JSON object.
        OSError: the file cannot be read (``FileNotFoundError`` when it does not exist).
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]  # the part after the last newline is incomplete (or empty)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {number}: not a JSON record ({e.msg})") from e
        if not isinstance(record, dict):
            raise DataError(f"{path}, line {number}: not a JSON object")
        records.append(record)
    return records


@dataclass
class TrainSummary:
    """What :func:`fit` returns (and ``convnets train`` prints as its last line)."""

    epochs: int
    metrics: dict[str, Any]
    best_top1: float | None = None  # multi-label: the best validation mAP (a fraction)
    best_epoch: int | None = None
    checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    metrics_file: Path | None = None
    unreadable_images: int = 0
    skipped_steps: int = 0
    seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    precision: str | None = None  # what validation computed in ("fp32", "bf16", "fp16"): scores differ a little

    def line(self) -> str:
        """One human-readable line."""
        m = self.metrics
        # Validation runs in training's precision (bf16 autocast on CPUs that have it): said, since `convnets
        # evaluate` in fp32 gives a slightly different score for the same checkpoint.
        ran = f" ({self.precision})" if self.precision else ""
        if "val_mAP" in m:  # multi-label
            if self.checkpoint is None:
                text = f"evaluated {m['images']} images{ran}: loss {m['val_loss']:.4f}, mAP {m['val_mAP']:.4f}"
            else:
                text = (f"trained {self.epochs} epochs in {self.seconds:.0f} s: val mAP {m['val_mAP']:.4f}{ran} (best "
                        f"{self.best_top1 or 0:.4f} at epoch {self.best_epoch}), macro F1 {m['val_f1']:.3f} at its "
                        f"thresholds, {format_rate(m.get('img_per_s', 0))} img/s; checkpoint {self.checkpoint}")
        elif self.checkpoint is None:  # --evaluate
            text = (f"evaluated {m['images']} images{ran}: loss {m['val_loss']:.4f}, top-1 {m['val_top1']:.2f}%, "
                    f"top-5 {m['val_top5']:.2f}%")
            if "ema_val_top1" in m:
                text += f"; EMA top-1 {m['ema_val_top1']:.2f}%, top-5 {m['ema_val_top5']:.2f}%"
        else:
            text = (f"trained {self.epochs} epochs in {self.seconds:.0f} s: val top-1 {m.get('val_top1', 0):.2f}%{ran} "
                    f"(best {self.best_top1 or 0:.2f}% at epoch {self.best_epoch}), "
                    f"{format_rate(m.get('img_per_s', 0))} img/s; checkpoint {self.checkpoint}")
            if self.skipped_steps:
                text += f"; {self.skipped_steps} steps skipped (non-finite)"
        if self.unreadable_images:
            text += f"; {self.unreadable_images} unreadable images skipped"
        return text
