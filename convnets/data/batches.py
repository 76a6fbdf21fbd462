"""What every training data backend yields and shares: :data:`Batch`, :class:`DataSource`, seeds.

Both the ``pytorch`` backend (:mod:`convnets.data.folders`) and the DALI backends
(:mod:`convnets.data.dali`) import these from here, so neither imports the other at module level
(``data`` imports ``dali`` lazily, only when a DALI backend is asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from torch import Tensor

__all__ = ["Batch", "DataSource", "Target", "sample_seed"]

#: ``(images, targets, unreadable)``: uint8 or normalised float images, class indices (or float
#: multi-hot rows ``[N, C]`` of a multi-label set), and the number of image files that could not be
#: read for this batch.
Batch = tuple[Tensor, Tensor, int]
#: A sample's target: its class index, or its multi-hot vector (multi-label).
Target = int | tuple[float, ...]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of sample ``index`` in ``epoch``: a function of these three only."""
    return int(np.random.SeedSequence((seed, epoch, index)).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class DataSource:
    """What the training loop needs from a backend.

    Attributes:
        classes: class names, index = label.
        multilabel: targets are multi-hot rows (a labels CSV), not class indices.
        steps_per_epoch: training batches per process and epoch (equal on every rank).
        train_epoch: ``epoch -> batches`` of this process's shard.
        val: ``() -> batches`` of this process's part of the validation set (no duplicates).
        num_train, num_val: images in the whole training / validation set.
    """

    classes: list[str]
    steps_per_epoch: int
    train_epoch: Callable[[int], Iterable[Batch]]
    val: Callable[[], Iterable[Batch]]
    num_train: int
    num_val: int
    multilabel: bool = False
