"""Turn a checkpoint file into a model, fast and safely.

* Files are read with ``weights_only=True``: a checkpoint can never run code. ``.safetensors``
  files (recognised by name or by their first bytes) are read with the safetensors library and
  never reach the unpickler (see :mod:`convnets.weights.safetensors_io`).
* Zip-format files are memory-mapped (``mmap=True``), so no tensor is copied into memory before
  it is needed; legacy (pre-1.6) files fall back to a normal read.
* The model is built on the ``meta`` device (no random initialisation, no allocation) and the
  checkpoint's tensors are assigned to it (``load_state_dict(assign=True)``).
* A checkpoint that does not fit gets a short, specific report rather than PyTorch's full key dump.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from convnets.errors import CheckpointError
from convnets.models.resnet import ResNet
from convnets.models.specs import ArchSpec, registered_name
from convnets.weights.layouts import infer_spec, split_checkpoint, to_canonical
from convnets.weights.safetensors_io import is_safetensors, read_safetensors

__all__ = ["build_model", "check_fits", "meta_model", "read_checkpoint", "read_state_dict"]

log = logging.getLogger(__name__)

# Upstream training checkpoints store metrics such as best_prec1 as numpy scalars; these
# reconstructors only rebuild numbers and dtypes, so allowing them keeps weights_only safe.
# Pickles name the scalar reconstructor by the module path of the numpy that wrote them.
_np_scalar = (np._core if hasattr(np, "_core") else np.core).multiarray.scalar
_SAFE_NUMPY = [(_np_scalar, "numpy.core.multiarray.scalar"), (_np_scalar, "numpy._core.multiarray.scalar"),
               np.dtype, *{type(np.dtype(t)) for t in "?bBhHiIlLqQefdgFD"}]

_SHOWN = 4  # keys listed per kind of mismatch


def read_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint file with ``weights_only=True``, memory-mapped when the format allows.

    A safetensors file is returned as ``{"state_dict": tensors, ...metadata}``, the shape of a
    self-describing training checkpoint (see :func:`~convnets.weights.safetensors_io.read_safetensors`).

    Raises:
        CheckpointError: the file is missing, unreadable, not a PyTorch or safetensors checkpoint,
            or holds objects other than tensors and plain containers.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    if is_safetensors(path):
        return read_safetensors(path)
    try:
        # Only the zip format (torch >= 1.6) can be memory-mapped; legacy files are read whole.
        mmap = zipfile.is_zipfile(path)
        with torch.serialization.safe_globals(_SAFE_NUMPY):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        culprit = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the global it refused
        if culprit:
            raise CheckpointError(
                f"refusing to load {path}: it references {culprit.group(1)}, a Python object other than "
                "tensors and plain containers, which could run code when unpickled. Re-save it as "
                "torch.save(model.state_dict(), path) from a trusted environment") from e
        raise _not_a_checkpoint(path, e) from e
    except Exception as e:  # noqa: BLE001 -- on arbitrary bytes the unpickler fails with any exception type
        raise _not_a_checkpoint(path, e) from e


def _not_a_checkpoint(path: Path, e: Exception) -> CheckpointError:
    if isinstance(e, pickle.UnpicklingError):
        reason = "unreadable pickle data"  # torch's own text here is advice about weights_only
    else:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"{path} is not a PyTorch checkpoint (truncated, or another kind of file): "
                           f"{type(e).__name__}: {reason[:200]}")


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
    lines.append(_diagnose(state_dict, model_name))
    raise CheckpointError(" ".join(lines))


def _diagnose(state_dict: Mapping[str, Tensor], model_name: str) -> str:
    if any(".se.fc1." in k for k in state_dict):
        return ("Keys like 'layer1.0.se.fc1.weight' come from timm's seresnext101_32x4d, a different "
                "network (SE squeeze of C/16 channels, other placement) whose weights cannot be "
                "converted; use timm for it, or NVIDIA's se_resnext101_32x4d weights here.")
    try:
        spec, _ = infer_spec(state_dict)
    except CheckpointError:
        return "It does not look like a ResNet-family checkpoint."
    named = registered_name(spec)
    if named and named != model_name:
        return f"The file holds a {named}: load it with convnets.{named}(...) or convnets.load_model(path)."
    return f"The file holds this architecture: {spec}; convnets.load_model(path) rebuilds it."


def meta_model(spec: ArchSpec, state_dict: Mapping[str, Tensor],
               model_kwargs: Mapping[str, Any] | None = None) -> ResNet:
    """``spec`` built on the meta device with the checkpoint's head size: nothing allocated, ready
    for :func:`check_fits` and ``load_state_dict(assign=True)``."""
    num_classes = state_dict["fc.weight"].shape[0] if "fc.weight" in state_dict else 0
    with torch.device("meta"):
        return ResNet(spec, num_classes, **(model_kwargs or {}))


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
