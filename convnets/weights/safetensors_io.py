"""safetensors files: weights without pickle, memory-mapped, self-describing through their metadata.

A file this package writes holds the canonical state dict (``layer1..N`` keys, see
:mod:`convnets.weights.layouts`) and, in the safetensors header's string-to-string metadata:

* ``format``: ``"pt"`` (the convention other tools read);
* ``arch_spec``: ``ArchSpec.to_dict()`` as JSON, so ``convnets.load_model`` needs no model name;
* ``class_names``: a JSON list of strings (optional);
* ``image_size``: the crop size the weights were trained for, in decimal (optional; at most
  :data:`~convnets.constants.MAX_IMAGE_SIZE`);
* ``multilabel``: ``"true"`` for a multi-label classifier (a sigmoid per class), with ``thresholds``,
  a JSON list of its per-class decision thresholds (optional).

:func:`read_safetensors` turns such a file into the same dict a self-describing training
checkpoint is (``state_dict``, ``arch_spec``, ``class_names``, ``config["image_size"]``, ``multilabel``,
``thresholds``), so every
reader of checkpoints handles both. safetensors files written by other tools (no metadata, or
other entries, which are kept as strings under ``safetensors_metadata``) are read too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from convnets.constants import MAX_IMAGE_SIZE
from convnets.errors import CheckpointError, InvalidArgumentError
from convnets.fileio import atomic_write
from convnets.models.specs import ArchSpec, short_repr
from convnets.weights.record import is_thresholds

__all__ = ["SUFFIX", "is_safetensors", "read_safetensors", "save_safetensors"]

SUFFIX = ".safetensors"
_KNOWN = ("format", "arch_spec", "class_names", "image_size", "multilabel", "thresholds")
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit on the JSON header


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is named ``*.safetensors`` or starts like one (8-byte header size, then ``{``).

    PyTorch checkpoints start with ``PK`` (zip) or ``0x80`` (a pickle), so the two never collide.
    """
    path = Path(path)
    if path.suffix.lower() == SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= min(_MAX_HEADER, size - 8)


def _image_size(text: str) -> int:
    """The ``image_size`` metadata entry: decimal digits for a size from 1 to ``MAX_IMAGE_SIZE``."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 8 and 0 < int(digits) <= MAX_IMAGE_SIZE):
        raise ValueError(f"its image_size {short_repr(text)} is not a size from 1 to {MAX_IMAGE_SIZE} px")
    return int(digits)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a safetensors file, memory-mapped (the tensors point into the file's mapping).

    Returns:
        ``{"state_dict": tensors, ...}`` plus, when the metadata has them, ``arch_spec`` (a dict),
        ``class_names`` (a list), ``config`` (``{"image_size": int}``) and ``safetensors_metadata``
        (other entries, as strings).

    Raises:
        CheckpointError: the file is not a valid safetensors file, or its metadata is malformed
            (including an ``image_size`` above :data:`~convnets.constants.MAX_IMAGE_SIZE`).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated, or another kind of "
                              f"file): {reason[:200]}") from e
    out: dict[str, Any] = {"state_dict": tensors}
    try:
        if "arch_spec" in metadata:
            spec = json.loads(metadata["arch_spec"])
            if not isinstance(spec, dict):
                raise ValueError("its arch_spec is not a JSON object")
            out["arch_spec"] = spec
        if "class_names" in metadata:
            names = json.loads(metadata["class_names"])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("its class_names is not a JSON list of strings")
            out["class_names"] = names
        if "image_size" in metadata:
            out["config"] = {"image_size": _image_size(metadata["image_size"])}
        if metadata.get("multilabel") == "true":
            out["multilabel"] = True
            if "thresholds" in metadata:
                thresholds = json.loads(metadata["thresholds"])
                if not is_thresholds(thresholds):
                    raise ValueError("its thresholds is not a JSON list of numbers")
                out["thresholds"] = [float(t) for t in thresholds]
    except RecursionError:  # JSON nested thousands deep
        raise CheckpointError(f"{path} has malformed convnets metadata in its safetensors header: a JSON value nested "
                              "too deeply") from None
    except ValueError as e:
        raise CheckpointError(f"{path} has malformed convnets metadata in its safetensors header: {e}") from e
    others = {k: v for k, v in metadata.items() if k not in _KNOWN}
    if others:
        out["safetensors_metadata"] = others
    return out


def save_safetensors(
    model_or_state_dict: torch.nn.Module | Mapping[str, Tensor],
    path: str | os.PathLike[str],
    *,
    arch_spec: ArchSpec | Mapping[str, Any] | None = None,
    class_names: Sequence[str] | None = None,
    image_size: int | None = None,
    thresholds: Sequence[float] | None = None,
) -> Path:
    """Write weights to a safetensors file atomically (see :mod:`convnets.fileio`).

    Args:
        model_or_state_dict: a model (its ``state_dict()`` is written, and its ``spec``,
            ``class_names`` and ``input_size`` are the defaults of the arguments below) or a
            state dict, written as it is.
        path: the file to write (conventionally ``*.safetensors``).
        arch_spec: the architecture, recorded so that ``convnets.load_model(path)`` rebuilds it.
        class_names: names of the classifier's outputs.
        image_size: the crop size the weights expect.
        thresholds: the per-class decision thresholds of a multi-label classifier (recorded with
            ``multilabel``; a model's ``thresholds`` by default).

    Returns:
        ``path``.

    Raises:
        InvalidArgumentError: a tensor is not a tensor, or ``class_names`` / ``image_size`` /
            ``arch_spec`` is not valid.
    """
    from safetensors.torch import save

    if isinstance(model_or_state_dict, torch.nn.Module):
        model = model_or_state_dict
        state_dict: Mapping[str, Any] = model.state_dict()
        arch_spec = arch_spec if arch_spec is not None else getattr(model, "spec", None)
        class_names = class_names if class_names is not None else getattr(model, "class_names", None)
        image_size = image_size if image_size is not None else getattr(model, "input_size", None)
        thresholds = thresholds if thresholds is not None else getattr(model, "thresholds", None)
    else:
        state_dict = model_or_state_dict
    metadata = {"format": "pt"}
    if arch_spec is not None:
        try:
            spec = arch_spec if isinstance(arch_spec, ArchSpec) else ArchSpec(**arch_spec)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"arch_spec is not a valid architecture: {e}") from e
        metadata["arch_spec"] = json.dumps(spec.to_dict())
    if class_names is not None:
        if isinstance(class_names, str) or not all(isinstance(n, str) for n in class_names):
            raise InvalidArgumentError(f"class_names must be a list of strings, got {class_names!r:.80}")
        metadata["class_names"] = json.dumps(list(class_names))
    if image_size is not None:
        if isinstance(image_size, bool) or not isinstance(image_size, int) or not 0 < image_size <= MAX_IMAGE_SIZE:
            raise InvalidArgumentError(f"image_size must be a positive integer of at most {MAX_IMAGE_SIZE}, got "
                                       f"{short_repr(image_size)}")
        metadata["image_size"] = str(image_size)
    if thresholds is not None:
        if not is_thresholds(thresholds):
            raise InvalidArgumentError(f"thresholds must be a list of numbers, got {short_repr(thresholds)}")
        metadata["multilabel"] = "true"
        metadata["thresholds"] = json.dumps([float(t) for t in thresholds])

    tensors: dict[str, Tensor] = {}
    storages: set[tuple[int, int]] = set()
    for key, value in state_dict.items():
        if not isinstance(value, Tensor):
            raise InvalidArgumentError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        t = value.detach().cpu().contiguous()
        storage = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if storage in storages:
            t = t.clone()  # safetensors refuses tensors that share memory (e.g. tied weights)
        storages.add(storage)
        tensors[key] = t
    data = save(tensors, metadata=metadata)
    path = Path(path)
    atomic_write(path, lambda f: f.write(data))
    return path
