"""Checkpoint layouts that exist in the wild, detected and converted to this package's keys.

This package's parameter names are those of the NGC 20.06 files (and torchvision / timm):
``conv1``, ``bn1``, ``layer1`` .. ``layer4``, ``fc``, SE weights as 2-D ``Linear`` matrices under
``layer{s}.{i}.squeeze.squeeze`` / ``.squeeze.expand``. What else is accepted:

* a ``module.`` prefix (saved from DDP; stripped from each key before upstream's
  ``state_dict_key_map_fn`` runs, as upstream does) or ``_orig_mod.`` (saved from ``torch.compile``);
* the newer upstream naming ``layers.{0..3}`` instead of ``layer{1..4}``;
* SE weights stored as 1x1 convolutions ``[C_out, C_in, 1, 1]`` (upstream ``trt=True`` / newer code);
* training checkpoints ``{"state_dict": ..., "state_dict_ema": ..., "optimizer": ...}`` (upstream's
  and this package's), and ``{"model": ...}`` as torchvision's and timm's training scripts save;
* timm's ``resnext101_32x4d`` state dicts, whose keys already match.

Upstream applied the ``layer{N}`` -> ``layers.{N-1}`` remap only for ``pretrained=True`` downloads, so
an NGC file passed as ``pretrained_from_file`` failed to load (DeepLearningExamples issue #1268).
Here every source goes through the same :func:`to_canonical`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from convnets.errors import CheckpointError
from convnets.models.resnet import ArchSpec
from convnets.models.specs import check_num_classes
from convnets.weights.record import STATE_DICT, STATE_DICT_EMA, ModelRecord

__all__ = ["head_size", "infer_spec", "split_checkpoint", "to_canonical"]

_DDP_PREFIX = "module."
_WRAPPER_PREFIXES = (_DDP_PREFIX, "_orig_mod.")
_SEQUENTIAL_STAGE = re.compile(r"^layers\.(\d+)\.")
_SE_WEIGHT = re.compile(r"\.squeeze\.(squeeze|expand)\.weight$")


def split_checkpoint(obj: Any, *, use_ema: bool = False, source: str = "checkpoint"
                     ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Separate the model weights from whatever else a checkpoint file holds.

    Args:
        obj: what ``torch.load`` returned.
        use_ema: take ``state_dict_ema`` (exponential moving average of the weights) from a
            training checkpoint instead of ``state_dict``.
        source: name of the file, for error messages.

    Returns:
        ``(state_dict, metadata)``: the tensors, and the checkpoint's other top-level entries
        (empty for a plain state dict).

    Raises:
        CheckpointError: no state dict can be found in ``obj``, or its recorded image size is above
            the limit (:meth:`ModelRecord.from_metadata`, checked here where the file's name is known).
    """
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{source} holds a {type(obj).__name__}, not a state dict or a training "
                              "checkpoint; save model.state_dict() rather than the model object")
    key = next((k for k in (STATE_DICT, "model") if isinstance(obj.get(k), Mapping)), None)
    if key is None:
        if not obj or not all(isinstance(v, Tensor) for v in obj.values()):
            keys = ", ".join(map(str, list(obj)[:8]))
            raise CheckpointError(f"{source} has no model weights: expected a state dict or a dict with "
                                  f"a '{STATE_DICT}' entry, found the keys [{keys}]")
        if use_ema:
            raise CheckpointError(f"{source} is a plain state dict; it has no '{STATE_DICT_EMA}' to use")
        return dict(obj), {}
    if use_ema:
        if not isinstance(obj.get(STATE_DICT_EMA), Mapping):
            raise CheckpointError(f"{source} has no '{STATE_DICT_EMA}' (it was saved without EMA); "
                                  "load it without use_ema")
        key = STATE_DICT_EMA
    metadata = {k: v for k, v in obj.items() if k not in (STATE_DICT, STATE_DICT_EMA, "model")}
    ModelRecord.from_metadata(metadata, source=source)  # refuses sizes that would exhaust memory later
    return dict(obj[key]), metadata


def to_canonical(state_dict: Mapping[str, Tensor],
                 key_map_fn: Callable[[str], str] | None = None) -> tuple[dict[str, Tensor], str]:
    """Convert a state dict of any known layout to this package's keys and shapes.

    Args:
        state_dict: the tensors of a checkpoint (see :func:`split_checkpoint`).
        key_map_fn: upstream's ``state_dict_key_map_fn``. As upstream's entry points do, it is
            called on each key after ``module.`` (DDP's prefix) has been stripped from it, and
            before any other conversion, so that maps written for upstream (e.g. to the
            ``layers.N`` naming, or dropping a wrapper's ``backbone.``) work unchanged.

    Returns:
        ``(state_dict, layout)`` where ``layout`` describes what was found, e.g.
        ``"layer1..4 (module. prefix)"``. Tensors are not copied.
    """
    notes: list[str] = []
    items = list(state_dict.items())
    # Upstream strips "module." key by key, then calls the user's map (SPEC section 7).
    if any(k.startswith(_DDP_PREFIX) for k, _ in items):
        items = [(k[len(_DDP_PREFIX):] if k.startswith(_DDP_PREFIX) else k, v) for k, v in items]
        notes.append(f"{_DDP_PREFIX} prefix")
    if key_map_fn is not None:
        items = [(key_map_fn(k), v) for k, v in items]
    # Other wrappers (torch.compile, or DDP inside it) only when every key has the prefix.
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if items and all(k.startswith(prefix) for k, _ in items):
                items = [(k[len(prefix):], v) for k, v in items]
                if f"{prefix} prefix" not in notes:
                    notes.append(f"{prefix} prefix")
                stripped = True
    naming = "layer1..N"
    if any(_SEQUENTIAL_STAGE.match(k) for k, _ in items):
        naming = "layers.0..N-1"
        items = [(_SEQUENTIAL_STAGE.sub(lambda m: f"layer{int(m.group(1)) + 1}.", k), v) for k, v in items]
    out: dict[str, Tensor] = {}
    for k, v in items:
        if _SE_WEIGHT.search(k) and v.dim() == 4:
            v = v.flatten(1)  # 1x1 conv weight [out, in, 1, 1] == Linear weight [out, in]
            if "SE as 1x1 conv" not in notes:
                notes.append("SE as 1x1 conv")
        out[k] = v
    return out, naming + (f" ({', '.join(notes)})" if notes else "")


def head_size(state_dict: Mapping[str, Tensor]) -> int:
    """The classifier's outputs in a canonical state dict: its ``fc.weight`` rows (0 without a classifier)."""
    return state_dict["fc.weight"].shape[0] if "fc.weight" in state_dict else 0


def infer_spec(state_dict: Mapping[str, Tensor], source: str = "checkpoint") -> tuple[ArchSpec, int]:
    """Read the architecture off a canonical state dict's tensor shapes.

    Args:
        state_dict: a state dict in this package's layout (see :func:`to_canonical`).
        source: name of the file, for error messages.

    Returns:
        ``(spec, num_classes)``; ``num_classes`` is 0 when the checkpoint has no classifier.

    Raises:
        CheckpointError: the tensors are not those of a ResNet-family network.
    """
    def shape(key: str) -> torch.Size:
        if key not in state_dict:
            raise CheckpointError(f"{source} is not a ResNet-family checkpoint: it has no '{key}' "
                                  f"(keys start with {sorted(state_dict)[:4]})")
        return state_dict[key].shape

    layers: list[int] = []
    widths: list[int] = []
    while f"layer{len(layers) + 1}.0.conv1.weight" in state_dict:
        stage = len(layers) + 1
        blocks = 0
        while f"layer{stage}.{blocks}.conv1.weight" in state_dict:
            blocks += 1
        layers.append(blocks)
        widths.append(shape(f"layer{stage}.0.conv1.weight")[0])
    stem_width = shape("conv1.weight")[0]
    if not layers:
        shape("layer1.0.conv1.weight")  # raises with the list of keys found
    expansion = shape("layer1.0.conv3.weight")[0] // widths[0]
    cardinality = widths[0] // shape("layer1.0.conv2.weight")[1]
    se = state_dict.get("layer1.0.squeeze.squeeze.weight")
    num_classes = head_size(state_dict)
    try:
        check_num_classes(num_classes, "its classifier's outputs (fc.weight rows)")
        spec = ArchSpec(layers=tuple(layers), widths=tuple(widths), expansion=expansion,
                        cardinality=cardinality, se_squeeze=None if se is None else se.shape[0],
                        stem_width=stem_width)
    except ValueError as e:
        raise CheckpointError(f"{source}: cannot infer the architecture: {e}") from e
    return spec, num_classes
