"""Turn a checkpoint file into a model, fast and safely.

* Files are read by :func:`convnets.weights.files.read_checkpoint`: ``weights_only=True`` (a
  checkpoint can never run code), memory-mapped; ``.safetensors`` through the safetensors library.
* The model is built on the ``meta`` device (no random initialisation, no allocation) and the
  checkpoint's tensors are assigned to it (``load_state_dict(assign=True)``).
* A checkpoint that does not fit gets a short, specific report rather than PyTorch's full key dump.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from convnets.errors import CheckpointError
from convnets.models.resnet import ResNet
from convnets.models.specs import ArchSpec, registered_name
from convnets.weights.files import read_checkpoint
from convnets.weights.layouts import head_size, infer_spec, split_checkpoint, to_canonical

__all__ = ["build_model", "check_fits", "checkpoint_classes", "meta_model", "read_state_dict"]

log = logging.getLogger(__name__)

_SHOWN = 4  # keys listed per kind of mismatch


def read_state_dict(path: str | os.PathLike[str], *, key_map_fn: Callable[[str], str] | None = None,
                    use_ema: bool = False) -> tuple[dict[str, Tensor], dict[str, Any], str]:
    """Read a checkpoint of any known layout (PyTorch or safetensors) and convert it to this package's keys.

    Args:
        path: the file.
        key_map_fn: upstream's ``state_dict_key_map_fn``: called on each key with ``module.``
            already stripped, before any other conversion (as upstream's entry points do).
        use_ema: take the EMA weights of a training checkpoint.

    Returns:
        ``(state_dict, metadata, layout)``: see :func:`convnets.weights.layouts.split_checkpoint`
        and :func:`convnets.weights.layouts.to_canonical`.
    """
    state_dict, metadata = split_checkpoint(read_checkpoint(path), use_ema=use_ema, source=str(path))
    state_dict, layout = to_canonical(state_dict, key_map_fn)
    return state_dict, metadata, layout


def checkpoint_classes(path: str | os.PathLike[str]) -> int:
    """The number of classes of the model in a checkpoint file, without building it: the file is
    memory-mapped where its format allows, and only the classifier's shape is read.

    Raises:
        CheckpointError: the file cannot be read as a checkpoint (see :func:`read_state_dict`).
    """
    return head_size(read_state_dict(path)[0])


def check_fits(model: torch.nn.Module, state_dict: Mapping[str, Tensor], *, model_name: str,
               source: str, layout: str) -> None:
    """Raise a short, actionable :class:`CheckpointError` unless ``state_dict`` fits ``model``.

    BatchNorm ``num_batches_tracked`` counters may be absent (several exporters drop them).
    """
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in state_dict and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state_dict if k not in expected]
    misshaped = [f"{k} {list(state_dict[k].shape)} (expected {list(expected[k])})"
                 for k in expected if k in state_dict and state_dict[k].shape != expected[k]]
    if not (missing or unexpected or misshaped):
        return
    lines = [f"{source} does not fit {model_name} (checkpoint layout: {layout})."]
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)):
        if keys:
            more = f", ... ({len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
            lines.append(f"{len(keys)} {label}: {', '.join(keys[:_SHOWN])}{more}.")
    diagnosis = _diagnose(state_dict, model_name)
    problem = " ".join(lines)
    # The advice names Python calls; on the command line the diagnosis alone, and the command that
    # knows its model option adds its own advice from `architecture` (see convnets.errors).
    raise CheckpointError(f"{problem} {diagnosis.text}{diagnosis.python}",
                          cli=f"{problem} {diagnosis.text}{diagnosis.neutral}", architecture=diagnosis.architecture)


@dataclass(frozen=True)
class _Diagnosis:
    """What a misfitting checkpoint holds: ``text``, then ``python`` advice or ``neutral`` words."""

    text: str
    python: str = ""
    neutral: str = ""
    architecture: str | None = None


def _diagnose(state_dict: Mapping[str, Tensor], model_name: str) -> _Diagnosis:
    if any(".se.fc1." in k for k in state_dict):
        return _Diagnosis("Keys like 'layer1.0.se.fc1.weight' come from timm's seresnext101_32x4d, a different "
                          "network (SE squeeze of C/16 channels, other placement) whose weights cannot be "
                          "converted; use timm for it, or NVIDIA's se_resnext101_32x4d weights here.")
    try:
        spec, _ = infer_spec(state_dict)
    except CheckpointError:
        return _Diagnosis("It does not look like a ResNet-family checkpoint.")
    named = registered_name(spec)
    if named and named != model_name:
        return _Diagnosis(f"The file holds a {named}", python=f": load it with convnets.{named}(...) or "
                          "convnets.load_model(path).", neutral=".", architecture=named)
    return _Diagnosis(f"The file holds this architecture: {spec}", python="; convnets.load_model(path) rebuilds it.",
                      neutral=".")


def meta_model(spec: ArchSpec, state_dict: Mapping[str, Tensor],
               model_kwargs: Mapping[str, Any] | None = None) -> ResNet:
    """``spec`` built on the meta device with the checkpoint's head size: nothing allocated, ready
    for :func:`check_fits` and ``load_state_dict(assign=True)``."""
    with torch.device("meta"):
        return ResNet(spec, head_size(state_dict), **(model_kwargs or {}))


def build_model(
    spec: ArchSpec,
    state_dict: dict[str, Tensor],
    *,
    num_classes: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    model_name: str = "model",
    source: str = "checkpoint",
    layout: str = "layer1..N",
) -> ResNet:
    """Build ``spec`` on the meta device and assign the checkpoint's tensors to it.

    Args:
        spec: the architecture.
        state_dict: canonical state dict (see :func:`read_state_dict`); its tensors become the
            model's parameters without a copy where dtype allows.
        num_classes: classifier outputs; ``None`` keeps the checkpoint's head. Any other number
            keeps the backbone and starts a freshly initialised head of that size.
        model_kwargs: ``last_bn_0_init`` / ``conv_init`` / ``fused_se`` for :class:`ResNet`.
        model_name, source, layout: for error messages.

    Returns:
        The model on CPU, in eval mode.

    Raises:
        CheckpointError: the tensors do not fit the architecture.
    """
    state_dict = {k: v.float() if v.is_floating_point() and v.dtype != torch.float32 else v
                  for k, v in state_dict.items()}
    model = meta_model(spec, state_dict, model_kwargs)
    ckpt_classes = model.num_classes
    check_fits(model, state_dict, model_name=model_name, source=source, layout=layout)
    for key, buf in model.state_dict().items():
        if key.endswith("num_batches_tracked") and key not in state_dict:
            state_dict[key] = torch.zeros((), dtype=buf.dtype)
    model.load_state_dict(state_dict, strict=True, assign=True)
    if num_classes is not None and num_classes != ckpt_classes:
        log.info("%s: replacing the %d-class head of %s with a new %d-class head",
                 model_name, ckpt_classes, source, num_classes)
        model.reset_classifier(num_classes)
    leftover = [name for name, t in model.state_dict().items() if t.is_meta]
    if leftover:  # an internal invariant: every tensor must come from the file or the new head
        raise RuntimeError(f"tensors left uninitialised after loading {source}: {leftover[:_SHOWN]}")
    return model.eval()
