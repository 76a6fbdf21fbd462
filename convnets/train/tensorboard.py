"""TensorBoard event files of a run (``OUT/tensorboard/``), written from the ``metrics.jsonl`` records.

The loop hands :meth:`TensorBoardLog.add_record` the same record that it appends to
``metrics.jsonl`` (after appending it), and :data:`SCALARS` is the one table that names each
TensorBoard tag's key in that record, so the two files cannot disagree. One point per epoch (step =
epoch): the loop has no logging interval inside an epoch, and per-step values would be numbers that
``metrics.jsonl`` does not hold.

Each session (a new run, or ``--resume``) starts a new event file in the same directory and logs
the epochs already done (the checkpoint's history, as ``metrics.jsonl`` is rewritten from it)
again, after a purge marker at step 1 (``SummaryWriter(purge_step=1)``): TensorBoard then hides
every event of the earlier files, also in a TensorBoard left open, so the directory shows exactly
the epochs the checkpoint holds, even when a session was killed between a checkpoint and its
events or when a run is resumed from an earlier checkpoint. Nothing is deleted; per-epoch scalars
cost a few hundred bytes per epoch per session.

Without the ``tensorboard`` package :func:`open_tensorboard` logs one line and returns ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SCALARS", "TENSORBOARD_DIR", "TensorBoardLog", "open_tensorboard"]

log = logging.getLogger(__name__)

#: Directory of the event files inside the run's output directory.
TENSORBOARD_DIR = "tensorboard"

#: TensorBoard tag -> key of the ``metrics.jsonl`` record; a key missing from a record is skipped
#: (``loss_scale`` exists under fp16 loss scaling only, ``ema_val_*`` with ``--ema``).
SCALARS: dict[str, str] = {
    "train/loss": "train_loss",
    "train/lr": "lr",
    "train/images_per_s": "img_per_s",
    "train/loss_scale": "loss_scale",
    "val/loss": "val_loss",
    "val/top1": "val_top1",
    "val/top5": "val_top5",
    "ema_val/loss": "ema_val_loss",
    "ema_val/top1": "ema_val_top1",
    "ema_val/top5": "ema_val_top5",
}


class TensorBoardLog:
    """A ``SummaryWriter`` fed with ``metrics.jsonl`` records.

    Args:
        writer: an open ``torch.utils.tensorboard.SummaryWriter``.
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def add_record(self, record: Mapping[str, Any]) -> None:
        """Log one epoch's record at step ``record["epoch"]`` and flush it to disk."""
        step = int(record["epoch"])
        for tag, key in SCALARS.items():
            value = record.get(key)
            # NaN is a real value (an epoch whose every step was skipped); None / absent is not.
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def open_tensorboard(directory: Path, history: Sequence[Mapping[str, Any]] = ()) -> TensorBoardLog | None:
    """Start the event files of a run in ``directory``, holding ``history`` already.

    Args:
        directory: ``OUT/tensorboard``; created if needed. The events of earlier sessions in it
            are hidden from TensorBoard (see the module docstring).
        history: the records of the epochs already done (a resumed run's checkpoint history).

    Returns:
        The log, or ``None`` (with one log line) when the ``tensorboard`` package is not installed.
    """
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it; its error is less clear)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("TensorBoard events not written: the tensorboard package is not installed "
                    "(pip install 'convnets-hub[tensorboard]', or pass --no-tensorboard)")
        return None
    directory.mkdir(parents=True, exist_ok=True)
    board = TensorBoardLog(SummaryWriter(log_dir=str(directory), purge_step=1))
    for record in history:
        board.add_record(record)
    return board
