"""What a checkpoint file says about its model, besides its weights: :class:`ModelRecord`.

Any checkpoint may carry ``arch_spec`` (the architecture), ``class_names``,
``config["image_size"]`` and, for a multi-label classifier, ``multilabel`` (``True``) and
``thresholds`` (per-class decision thresholds) next to its weights (``state_dict``, or ``state_dict_ema`` for the EMA
weights of a training run); :class:`ModelRecord` reads them leniently, so that
:func:`convnets.load_model` rebuilds a model from the file alone. The training checkpoint's full
schema is :class:`convnets.train.checkpoint.TrainingCheckpoint`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from convnets.constants import MAX_IMAGE_SIZE
from convnets.errors import CheckpointError
from convnets.models.specs import ArchSpec, short_repr

__all__ = ["STATE_DICT", "STATE_DICT_EMA", "ModelRecord", "is_int", "is_names", "is_thresholds"]

#: The entries holding model weights, for :func:`convnets.weights.layouts.split_checkpoint`.
STATE_DICT = "state_dict"
STATE_DICT_EMA = "state_dict_ema"


@dataclass(frozen=True)
class ModelRecord:
    """What a checkpoint's metadata says about its model, read leniently from any checkpoint file.

    Attributes:
        arch_spec: the recorded ``arch_spec`` entry, unchecked (see :meth:`spec`), or ``None``.
        class_names: the class names, if recorded as a list of strings.
        image_size: the training crop size from the recorded run configuration, if valid (at most
            :data:`~convnets.constants.MAX_IMAGE_SIZE`).
        multilabel: a multi-label classifier (a sigmoid per class, ``convnets train --multilabel``).
        thresholds: its per-class decision thresholds, if recorded as a list of numbers.
    """

    arch_spec: Any = None
    class_names: list[str] | None = None
    image_size: int | None = None
    multilabel: bool = False
    thresholds: list[float] | None = None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], source: str = "checkpoint") -> ModelRecord:
        """Read the non-weight entries of a checkpoint (``split_checkpoint``'s metadata).

        An image size that is not a positive int is ignored (other tools' configurations use the
        name for other things); one above :data:`~convnets.constants.MAX_IMAGE_SIZE` is refused,
        since preprocessing at that size would exhaust memory.

        Args:
            metadata: the checkpoint's entries other than its weights.
            source: name of the file, for error messages.

        Raises:
            CheckpointError: the recorded image size is above the limit.
        """
        names = metadata.get("class_names")
        config = metadata.get("config")
        size = config.get("image_size") if isinstance(config, Mapping) else None
        if is_int(size) and size > MAX_IMAGE_SIZE:
            raise CheckpointError(f"{source} records an image size of {short_repr(size)} px (its 'config' entry's "
                                  f"image_size); at most {MAX_IMAGE_SIZE} is allowed. Save it again with the size "
                                  "it was trained at")
        thresholds = metadata.get("thresholds")
        multilabel = metadata.get("multilabel") is True
        return cls(arch_spec=metadata.get("arch_spec"),
                   class_names=list(names) if is_names(names) else None,
                   image_size=size if is_int(size) and size > 0 else None, multilabel=multilabel,
                   thresholds=[float(t) for t in thresholds] if multilabel and is_thresholds(thresholds) else None)

    def spec(self, source: str = "checkpoint") -> ArchSpec | None:
        """The recorded architecture, or ``None`` when the checkpoint records none.

        Raises:
            CheckpointError: the recorded ``arch_spec`` is not a valid :class:`ArchSpec` (wrong
                types, or sizes above the bounds :class:`ArchSpec` checks before anything is built).
        """
        if not isinstance(self.arch_spec, Mapping):
            return None
        try:
            return ArchSpec(**self.arch_spec)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source} has an invalid 'arch_spec' entry: {e}") from e


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_names(value: object) -> TypeGuard[list[str] | tuple[str, ...]]:
    return isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value)


def is_thresholds(value: object) -> TypeGuard[list[float] | tuple[float, ...]]:
    """A list of finite numbers (per-class decision thresholds)."""
    return isinstance(value, (list, tuple)) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in value)
