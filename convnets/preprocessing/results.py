"""Turn softmax outputs into readable top-n (class name, percentage) lists, as upstream does."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from convnets.errors import InvalidArgumentError, InvalidArgumentTypeError

from .classes import _table

__all__ = ["pick_n_best"]


def pick_n_best(predictions: torch.Tensor | npt.NDArray[Any], n: int = 5, *,
                verbose: bool = True) -> list[list[tuple[str, str]]]:
    """The ``n`` most probable classes of each sample, best first, printed as upstream prints them.

    Ties are broken by the lower class index (a stable sort of the negated scores), so the order
    is deterministic; NaN scores sort last.

    Args:
        predictions: softmax outputs ``[N, num_classes]``, or ``[num_classes]`` for one sample;
            any device and float dtype (computed in float32 on the CPU, as upstream).
        n: how many classes to return per sample, ``1 <= n <= num_classes``.
        verbose: print ``sample {i}: [...]`` per sample (upstream behaviour).

    Returns:
        Per sample, a list of ``n`` tuples ``(class_name, "87.3%")``.

    Raises:
        InvalidArgumentTypeError: ``predictions`` is not a tensor or array of real numbers (a
            ``TypeError``).
        InvalidArgumentError: ``n`` is out of range, or the shape does not end in ``num_classes``
            (a ``ValueError``).
    """
    names = _table()[1]
    if isinstance(predictions, np.ndarray):
        predictions = torch.from_numpy(predictions)
    if not isinstance(predictions, torch.Tensor):
        raise InvalidArgumentTypeError(
            f"predictions must be a torch.Tensor or numpy array, got {type(predictions).__name__}.")
    if predictions.dtype == torch.bool or predictions.is_complex():
        raise InvalidArgumentTypeError(f"predictions must hold real scores, got dtype {predictions.dtype}.")
    if predictions.ndim not in (1, 2) or predictions.shape[-1] != len(names):
        raise InvalidArgumentError(
            f"predictions must have shape [N, {len(names)}] or [{len(names)}] (softmax over the "
            f"ImageNet classes), got {list(predictions.shape)}.")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(names):
        raise InvalidArgumentError(f"n must be an int from 1 to {len(names)}, got {n!r}.")
    scores = predictions.detach().float().cpu().reshape(-1, len(names)).numpy()
    top = np.argsort(-scores, axis=-1, kind="stable")[:, :n]
    results = []
    for sample, classes in enumerate(top):
        best = [(f"{names[c]}", f"{100 * scores[sample, c]:.1f}%") for c in classes]
        if verbose:
            print(f"sample {sample}: {best}")
        results.append(best)
    return results
