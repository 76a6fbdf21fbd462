"""Training checkpoints: atomic files that ``torch.load(weights_only=True)`` reads back.

A checkpoint is a dict of tensors, plain containers and scalars:

``state_dict`` (model weights, no ``module.`` prefix), ``state_dict_ema`` and ``ema_updates``
(with EMA), ``optimizer``, ``scheduler``, ``scaler`` (GradScaler state or None), ``epoch``
(epochs completed), ``step`` (optimizer steps), ``best_top1`` / ``best_epoch``, ``history`` (the
per-epoch metrics so far), ``rng`` (torch / CUDA / numpy / Python generator states), ``config``
(the run's :class:`~convnets.train.config.TrainConfig` as a dict), ``arch`` (model name),
``arch_spec`` (``ArchSpec.to_dict()``), ``class_names``, ``world_size`` and ``format``.
``arch_spec`` and ``class_names`` make it self-describing: ``convnets.load_model(path)`` rebuilds
the model from it alone.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convnets.errors import CheckpointError
from convnets.fileio import atomic_write
from convnets.weights.load import read_checkpoint

__all__ = ["CHECKPOINT", "BEST", "FORMAT", "atomic_copy", "atomic_save", "get_rng_state",
           "read_training_checkpoint", "set_rng_state"]

CHECKPOINT = "checkpoint.pth.tar"
BEST = "model_best.pth.tar"
FORMAT = "convnets-train/1"
REQUIRED = ("state_dict", "optimizer", "scheduler", "epoch", "arch_spec", "class_names")


def atomic_save(obj: Mapping[str, Any], path: Path) -> None:
    """``torch.save`` to ``path`` atomically (temporary file + fsync + ``os.replace``)."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy a file atomically, e.g. the new best checkpoint to ``model_best.pth.tar``."""
    def write(f: Any) -> None:
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 20)
    atomic_write(dst, write)


def get_rng_state() -> dict[str, Any]:
    """Every global generator's state as tensors and plain values (``weights_only``-loadable)."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def read_training_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by ``convnets train`` (``weights_only``).

    Raises:
        CheckpointError: unreadable, or not a training checkpoint of this package.
    """
    ckpt = read_checkpoint(path)
    missing = [k for k in REQUIRED if not isinstance(ckpt, Mapping) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a convnets training checkpoint (no {', '.join(missing)}); "
                              "to fine-tune from its weights use --pretrained-from-file instead of --resume")
    return dict(ckpt)
