"""The training checkpoint's schema, in one place: :class:`TrainingCheckpoint` writes, validates and reads it.

``convnets train`` writes one after every epoch; ``--resume`` reads it back, and
:func:`convnets.load_model` rebuilds the model from it alone. The file is a dict of tensors, plain
containers and scalars (``torch.load(weights_only=True)`` reads it); its keys are the fields of
:class:`TrainingCheckpoint`, and no other module spells them:

``state_dict`` (model weights, no ``module.`` prefix), ``state_dict_ema`` and ``ema_updates``
(only with EMA), ``optimizer``, ``scheduler``, ``scaler`` (GradScaler state or None), ``epoch``
(epochs completed), ``step`` (optimizer steps), ``skipped_steps``, ``best_top1`` / ``best_epoch``,
``history`` (the per-epoch metrics so far), ``rng`` (torch / CUDA / numpy / Python generator
states), ``config`` (the run's ``TrainConfig`` as a dict), ``arch`` (model name), ``arch_spec``
(``ArchSpec.to_dict()``), ``class_names``, ``world_size`` and ``format`` (:data:`FORMAT`); a multi-label run (``--multilabel``)
also ``multilabel`` (``True``) and ``thresholds`` (the per-class decision thresholds chosen on the
validation set of that epoch), and its ``best_top1`` / ``best_epoch`` are those of the validation mAP
(a fraction, not a percentage).
``arch_spec``, ``class_names`` and ``config["image_size"]`` make it self-describing; other
checkpoint files may carry the same entries, which :class:`ModelRecord` reads leniently.

The run's files: ``checkpoint.pth.tar`` is rewritten after every epoch, ``model_best.pth.tar`` is a copy of the
best one so far (best validation top-1 of the model, not of its EMA), and ``model_best.safetensors``
holds that checkpoint's model weights (``state_dict``, what ``convnets.load_model`` reads from it by
default; the EMA weights stay in ``model_best.pth.tar``, ``load_model(..., use_ema=True)``) with the
architecture, class names and image size, so that ``convnets.load_model`` rebuilds the model from it
alone, without pickle. :func:`get_rng_state` is the random state a checkpoint records, so that a
resumed run continues every global generator where the interrupted run left it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from convnets.errors import CheckpointError, short_repr
from convnets.fileio import atomic_write
from convnets.models.specs import ArchSpec
from convnets.weights.files import read_checkpoint
from convnets.weights.record import STATE_DICT, STATE_DICT_EMA, ModelRecord, is_int, is_names, is_thresholds

__all__ = ["BEST", "BEST_SAFETENSORS", "CHECKPOINT", "FORMAT", "TrainingCheckpoint", "atomic_copy", "get_rng_state",
           "restore_rng_state", "set_rng_state", "unlike"]

#: Version of the schema; a file that names another one is refused rather than misread.
FORMAT = "convnets-train/1"
# Written only when the run keeps an EMA of the weights (older readers expect them absent).
_ONLY_WITH_EMA = (STATE_DICT_EMA, "ema_updates")
# Written only by a multi-label run (a single-label checkpoint stays as it was).
_ONLY_MULTILABEL = ("multilabel", "thresholds")

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
    # The dict form, by name: numpy's stub types a bare get_state() as this dict, but at run time
    # it returns the legacy tuple (legacy=True is the default).
    np_state = np.random.get_state(legacy=False)
    mt = np_state["state"]
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(mt["key"].astype(np.int64)), "pos": int(mt["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "cached_gaussian": float(np_state["gauss"])},
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
    }


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def unlike(given: Any, expected: Any, where: str) -> str | None:
    """Where a state read from a checkpoint differs in structure from ``expected``, the state this run
    would write in its place; ``None`` when it does not.

    Dicts must hold what ``expected`` holds where they have its keys (keys only one of them has are
    not compared: versions of PyTorch add and drop some), lists the same number of entries, tensors the
    same shape and dtype, numbers and strings the same kind; where ``expected`` holds ``None``
    anything goes.

    Args:
        given: what the checkpoint holds.
        expected: the state of a fresh run (its optimizer's ``state_dict()``, ...).
        where: the entry's name for the message (``"scheduler"``).

    Returns:
        ``"ENTRY (what it holds, expected what)"`` for the first difference, or ``None``.
    """
    def differs(what: str) -> str:
        return f"{where} ({_kind(given)}, expected {what})"
    if isinstance(expected, torch.Tensor):
        same = (isinstance(given, torch.Tensor) and given.shape == expected.shape and given.dtype == expected.dtype)
        return None if same else differs(_kind(expected))
    if isinstance(expected, Mapping):
        if not isinstance(given, Mapping):
            return differs("a dict")
        return next((found for key in expected if key in given
                     if (found := unlike(given[key], expected[key], f"{where}[{key!r}]")) is not None), None)
    if isinstance(expected, (list, tuple)):
        if not isinstance(given, (list, tuple)) or len(given) != len(expected):
            return differs(f"a list of {len(expected)}")
        return next((found for i, (g, e) in enumerate(zip(given, expected))
                     if (found := unlike(g, e, f"{where}[{i}]")) is not None), None)
    if isinstance(expected, bool):
        return None if isinstance(given, bool) else differs("True or False")
    if isinstance(expected, int):
        return None if is_int(given) else differs("an int")
    if isinstance(expected, float):
        return None if isinstance(given, (int, float)) and not isinstance(given, bool) else differs("a number")
    if isinstance(expected, str):
        return None if isinstance(given, str) else differs("a str")
    return None


def restore_rng_state(state: Any, source: str = "checkpoint") -> None:
    """:func:`set_rng_state` for a state read from a file: checked against this process's first.

    Raises:
        CheckpointError: the state is not of the shape :func:`get_rng_state` gives, or a generator
            refuses it.
    """
    current = get_rng_state()
    cuda = state.get("cuda", []) if isinstance(state, Mapping) else None
    # Another machine records another number of GPUs (restored only when it matches): not compared.
    problem = unlike(state, {k: v for k, v in current.items() if k != "cuda"}, "rng") or (
        None if isinstance(cuda, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in cuda)
        else unlike(cuda, [], "rng['cuda']"))
    if problem is None and not 0 <= state["numpy"]["pos"] <= len(current["numpy"]["keys"]):
        # numpy does not check it: a draw would read past the end of the generator's state.
        problem = f"rng['numpy']['pos'] ({short_repr(state['numpy']['pos'])}, expected 0 to {len(current['numpy']['keys'])})"
    if problem is None:
        try:
            set_rng_state(state)
        except (RuntimeError, ValueError, TypeError, OverflowError, KeyError, IndexError) as e:
            set_rng_state(current)  # not half restored
            problem = f"rng ({str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__})"
    if problem is not None:
        raise CheckpointError(f"{source} is a damaged convnets training checkpoint: {problem}")


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


def _is_history(value: object) -> bool:
    """A list of per-epoch metric records (what ``metrics.jsonl`` is rewritten from on resume)."""
    scalars = (str, int, float, bool, type(None))
    return isinstance(value, list) and all(
        isinstance(r, Mapping) and all(isinstance(k, str) and isinstance(v, scalars) for k, v in r.items())
        for r in value)


@dataclass
class TrainingCheckpoint:
    """One training checkpoint: everything a run needs to continue, and to rebuild its model.

    The fields without defaults are required in a file; the others default to a fresh run's
    values. Attributes are the file's keys (see the module docstring).
    """

    state_dict: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    epoch: int
    arch_spec: dict[str, Any]
    class_names: list[str]
    step: int = 0
    scaler: dict[str, Any] | None = None
    skipped_steps: int = 0
    state_dict_ema: dict[str, Any] | None = None
    ema_updates: int | None = None
    best_top1: float = -math.inf
    best_epoch: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    rng: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    arch: str | None = None
    world_size: int = 1
    multilabel: bool = False
    thresholds: list[float] | None = None
    format: str = FORMAT

    def to_dict(self) -> dict[str, Any]:
        """The file's contents: plain containers, ``weights_only``-loadable (tensors not copied)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.state_dict_ema is None:
            for key in _ONLY_WITH_EMA:
                del out[key]
        if not self.multilabel:
            for key in _ONLY_MULTILABEL:
                del out[key]
        return out

    def write(self, path: str | os.PathLike[str]) -> None:
        """``torch.save`` to ``path`` atomically: readers see the old file or the new one, never a part."""
        import torch

        data = self.to_dict()
        atomic_write(Path(path), lambda f: torch.save(data, f))

    @classmethod
    def validate(cls, obj: Any, source: str = "checkpoint") -> None:
        """Check that ``obj`` (what ``torch.load`` returned) is a training checkpoint of this schema.

        Raises:
            CheckpointError: required entries missing, of the wrong type, or another ``format``.
        """
        if not isinstance(obj, Mapping):
            raise CheckpointError(f"{source} is not a convnets training checkpoint (it holds a "
                                  f"{type(obj).__name__}, not a dict)")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in obj]
        if missing:
            raise CheckpointError(f"{source} is not a convnets training checkpoint (no {', '.join(missing)})")
        # A file without "format" is accepted: hand-made minimal checkpoints (and tests) omit it.
        version = obj.get("format", FORMAT)
        if version != FORMAT:
            raise CheckpointError(f"{source} is a training checkpoint of format {version!r}; this version of "
                                  f"convnets reads {FORMAT!r}")
        def count(value: object, least: int = 0) -> bool:
            return is_int(value) and value >= least

        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
            return lambda value: value is None or check(value)

        def mapping(value: object) -> bool:
            return isinstance(value, Mapping)

        epoch = obj["epoch"]
        checks: tuple[tuple[str, str, Callable[[object], bool]], ...] = (
            (STATE_DICT, "a dict", mapping), ("optimizer", "a dict", mapping), ("scheduler", "a dict", mapping),
            ("epoch", "an int >= 0", count), ("arch_spec", "a dict", mapping),
            ("class_names", "a list of str", is_names),
            # The optional entries that a resume restores, when present.
            ("step", "an int >= 0", count), ("skipped_steps", "an int >= 0", count),
            ("best_top1", "a number", number),
            ("best_epoch", "an int from 0 to epoch", lambda v: count(v) and (not count(epoch) or v <= epoch)),
            ("history", "a list of dicts of numbers and strings", _is_history),
            ("rng", "a dict or None", optional(mapping)), ("scaler", "a dict or None", optional(mapping)),
            (STATE_DICT_EMA, "a dict or None", optional(mapping)), ("ema_updates", "an int >= 0 or None", optional(count)),
            ("config", "a dict", mapping), ("arch", "a str or None", optional(lambda v: isinstance(v, str))),
            ("world_size", "an int >= 1", lambda v: count(v, 1)),
            ("multilabel", "True or False", lambda v: isinstance(v, bool)),
            ("thresholds", "a list of numbers, one per class, or None",
             optional(lambda v: is_thresholds(v) and (not is_names(obj["class_names"])
                                                      or len(v) == len(obj["class_names"])))),
        )
        wrong = [f"{k} ({short_repr(obj[k]) if is_int(obj[k]) else type(obj[k]).__name__}, expected {what})"
                 for k, what, ok in checks if k in obj and not ok(obj[k])]
        if wrong:
            raise CheckpointError(f"{source} is a damaged convnets training checkpoint: {', '.join(wrong)}")

    @classmethod
    def from_dict(cls, obj: Any, source: str = "checkpoint") -> TrainingCheckpoint:
        """Validate ``obj`` and wrap it (entries this schema does not know are dropped).

        Raises:
            CheckpointError: see :meth:`validate`.
        """
        cls.validate(obj, source)
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in obj.items() if k in names}
        values["class_names"] = list(values["class_names"])
        return cls(**values)

    @classmethod
    def read(cls, path: str | os.PathLike[str], *, hint: str = "") -> TrainingCheckpoint:
        """Read and validate a checkpoint file (``weights_only``, memory-mapped).

        Args:
            path: the file.
            hint: appended to the message when the file is not a training checkpoint, e.g. what
                option to use for other files.

        Raises:
            CheckpointError: missing or unreadable file, or not a training checkpoint of this schema.
        """
        obj = read_checkpoint(path)
        try:
            return cls.from_dict(obj, str(path))
        except CheckpointError as e:
            raise CheckpointError(f"{e}{'; ' + hint if hint else ''}") from e

    def model_spec(self, source: str = "checkpoint") -> ArchSpec:
        """The architecture the weights belong to.

        Raises:
            CheckpointError: ``arch_spec`` is not a valid :class:`ArchSpec`.
        """
        spec = ModelRecord(arch_spec=self.arch_spec).spec(source)
        if spec is None:  # validate() admits only mappings; this guards hand-built instances
            raise CheckpointError(f"{source} has no 'arch_spec' entry")
        return spec
