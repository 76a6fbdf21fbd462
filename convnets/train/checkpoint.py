"""The training run's files and global random state; the checkpoint's schema is
:class:`convnets.weights.checkpoint.TrainingCheckpoint`.

``checkpoint.pth.tar`` is rewritten after every epoch, ``model_best.pth.tar`` is a copy of the
best one so far (best validation top-1 of the model, not of its EMA), and ``model_best.safetensors``
holds that checkpoint's model weights (``state_dict``, what ``convnets.load_model`` reads from it by
default; the EMA weights stay in ``model_best.pth.tar``, ``load_model(..., use_ema=True)``) with the
architecture, class names and image size, so that ``convnets.load_model`` rebuilds the model from it
alone, without pickle. :func:`get_rng_state` is the random state a checkpoint records, so that a
resumed run continues every global generator where the interrupted run left it.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convnets.fileio import atomic_write

__all__ = ["BEST", "BEST_SAFETENSORS", "CHECKPOINT", "atomic_copy", "get_rng_state", "set_rng_state"]

CHECKPOINT = "checkpoint.pth.tar"
BEST = "model_best.pth.tar"
BEST_SAFETENSORS = "model_best.safetensors"


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
