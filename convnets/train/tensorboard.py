"""TensorBoard event files of a run (``OUT/tensorboard/``), written from the ``metrics.jsonl`` records.

Two TensorBoard runs (directories), each with its own horizontal axis:

* ``OUT/tensorboard/``: one point per epoch (step = epoch). The loop hands
  :meth:`TensorBoardLog.add_record` the same record that it appends to ``metrics.jsonl`` (after
  appending it), and :data:`SCALARS` is the one table that names each TensorBoard tag's key in that
  record, so the two files cannot disagree.
* ``OUT/tensorboard/steps/`` (:data:`STEPS_DIR`): the training scalars of :data:`STEP_SCALARS`
  (``train/loss``, ``train/lr``, ``train/images_per_s``) every ``--print-freq`` optimizer steps,
  each averaged over those steps, at the global optimizer step ``epoch * steps_per_epoch + step``
  (1-based), which a resumed run continues. ``metrics.jsonl`` does not hold these values; its
  per-epoch figures stay the reference. TensorBoard shows both runs on the same ``train/*`` charts:
  tick one run, or switch the horizontal axis to "relative" (time) to compare them.

Each session (a new run, or ``--resume``) starts a new event file in each directory. The epoch
run logs the epochs already done (the checkpoint's history, as ``metrics.jsonl`` is rewritten from
it) again, after a purge marker at step 1 (``SummaryWriter(purge_step=1)``); the steps run puts its
purge marker at the first step after the checkpoint. TensorBoard then hides every event of earlier
files from that step on, also in a TensorBoard left open, so the directory shows exactly the epochs
the checkpoint holds (and the steps of those epochs), even when a session was killed between a
checkpoint and its events or when a run is resumed from an earlier checkpoint. Nothing is deleted.

Without the ``tensorboard`` package :func:`open_tensorboard` logs one line and returns ``None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convnets.extras import install_hint

__all__ = ["SCALARS", "STEPS_DIR", "STEP_SCALARS", "TENSORBOARD_DIR", "TensorBoardLog", "open_tensorboard"]

log = logging.getLogger(__name__)

#: Directory of the event files inside the run's output directory.
TENSORBOARD_DIR = "tensorboard"
#: Subdirectory (a second TensorBoard run) of the per-interval training scalars.
STEPS_DIR = "steps"
#: The tags written every ``--print-freq`` optimizer steps (in :data:`STEPS_DIR`).
STEP_SCALARS = ("train/loss", "train/lr", "train/images_per_s")

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
    "val/mAP": "val_mAP",  # multi-label runs
    "val/f1": "val_f1",
    "ema_val/mAP": "ema_val_mAP",
    "ema_val/f1": "ema_val_f1",
}


class TensorBoardLog:
    """A ``SummaryWriter`` fed with ``metrics.jsonl`` records, and one for the per-interval scalars.

    Args:
        writer: an open ``torch.utils.tensorboard.SummaryWriter`` (the epoch run).
        open_steps: ``() -> SummaryWriter`` of the :data:`STEPS_DIR` run, called on the first
            :meth:`add_interval` (so a run too short for one interval gets no directory);
            ``None``: :meth:`add_interval` writes nothing.
    """

    def __init__(self, writer: Any, open_steps: Callable[[], Any] | None = None) -> None:
        self.writer = writer
        self._open_steps = open_steps
        self.steps_writer: Any = None

    def add_record(self, record: Mapping[str, Any]) -> None:
        """Log one epoch's record at step ``record["epoch"]`` and flush it to disk."""
        step = int(record["epoch"])
        for tag, key in SCALARS.items():
            value = record.get(key)
            # NaN is a real value (an epoch whose every step was skipped); None / absent is not.
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()

    def add_interval(self, step: int, loss: float, lr: float, images_per_s: float) -> None:
        """Log the training scalars of the optimizer steps up to global ``step`` (1-based).

        Written to disk by the writer's periodic flush, by :meth:`flush` and at :meth:`close`.
        """
        if self.steps_writer is None:
            if self._open_steps is None:
                return
            self.steps_writer = self._open_steps()
        for tag, value in zip(STEP_SCALARS, (loss, lr, images_per_s)):
            self.steps_writer.add_scalar(tag, float(value), global_step=step)

    def flush(self) -> None:
        """Write the pending per-interval events (the loop calls this after each epoch)."""
        if self.steps_writer is not None:
            self.steps_writer.flush()

    def close(self) -> None:
        """Flush and close the event files."""
        self.writer.close()
        if self.steps_writer is not None:
            self.steps_writer.close()


def open_tensorboard(directory: Path, history: Sequence[Mapping[str, Any]] = (), *,
                     first_step: int | None = None) -> TensorBoardLog | None:
    """Start the event files of a run in ``directory``, holding ``history`` already.

    Args:
        directory: ``OUT/tensorboard``; created if needed. The events of earlier sessions in it
            are hidden from TensorBoard (see the module docstring).
        history: the records of the epochs already done (a resumed run's checkpoint history).
        first_step: the global optimizer step this session starts after (0 for a new run);
            ``None``: no per-interval run (:meth:`TensorBoardLog.add_interval` writes nothing).

    Returns:
        The log, or ``None`` (with one log line) when the ``tensorboard`` package is not installed.
    """
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it; its error is less clear)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("TensorBoard events not written: the tensorboard package is not installed "
                    "(%s, or pass --no-tensorboard)", install_hint("tensorboard"))
        return None
    from convnets.fileio import make_output_dir

    make_output_dir(directory, base=directory.parent)  # the run's directory: nothing written through a link in it
    open_steps = None
    if first_step is not None:
        def open_steps() -> Any:
            # The purge marker hides the steps an earlier session logged past the checkpoint.
            return SummaryWriter(log_dir=str(make_output_dir(directory / STEPS_DIR, base=directory.parent)),
                                 purge_step=first_step + 1)
    board = TensorBoardLog(SummaryWriter(log_dir=str(directory), purge_step=1), open_steps)
    for record in history:
        board.add_record(record)
    return board
