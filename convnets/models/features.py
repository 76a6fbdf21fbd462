"""Backbones in timm's spelling: a ResNet without its head, returning the feature maps of chosen stages.

``convnets.get_model(name, features_only=True, out_indices=(1, 2, 3, 4), output_stride=16)`` builds a
:class:`ResNetFeatures`, the counterpart of what ``timm.create_model(..., features_only=True)``
returns: ``model(x)`` is a list of feature maps and ``model.feature_info`` says what each is
(:class:`FeatureInfo`: ``.channels()``, ``.reduction()``, ``.module_name()``), which is what
segmentation_models_pytorch's ``tu-`` encoders, mmpretrain's ``TIMMBackbone`` and transformers'
``TimmBackbone`` read.

Feature indices are timm's: 0 is the stem's output (stride 2, before max pooling), 1 .. 4 the
outputs of ``layer1`` .. ``layer4`` (C2 .. C5, stride 4 .. 32 at ``output_stride=32``). The default
here is ``(1, 2, 3, 4)``, the stages that detection and segmentation necks take (timm's default
includes the stem). The parameter names stay the classifier's (``conv1``, ``layer1.0.conv1``, ...),
so its checkpoints, torchvision's and mmdetection's key names load into it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from convnets.errors import InvalidArgumentError, short_repr
from convnets.models.resnet import ResNet, set_frozen_modes

__all__ = ["DEFAULT_OUT_INDICES", "FeatureInfo", "ResNetFeatures", "resolve_out_indices"]

#: The stages' outputs C2 .. C5 (what FPNs take); 0 would add the stem's.
DEFAULT_OUT_INDICES: tuple[int, ...] = (1, 2, 3, 4)


def resolve_out_indices(out_indices: object, num_features: int) -> tuple[int, ...]:
    """``out_indices`` as increasing indices from 0 to ``num_features - 1``, as timm reads them.

    Args:
        out_indices: a sequence of feature indices (negative ones count from the end), or an int N:
            the last N feature maps.
        num_features: how many feature maps the network has (the stem's and one per stage).

    Raises:
        InvalidArgumentError: not integers, out of range, repeated, or none.
    """
    if isinstance(out_indices, int) and not isinstance(out_indices, bool):
        if not 1 <= out_indices <= num_features:
            raise InvalidArgumentError(f"out_indices={out_indices} asks for the last {out_indices} feature maps, "
                                       f"but there are {num_features}", keyword="out_indices")
        return tuple(range(num_features - out_indices, num_features))
    if isinstance(out_indices, (str, bytes)) or not isinstance(out_indices, Sequence) or not out_indices or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in out_indices):
        raise InvalidArgumentError(f"out_indices must be a non-empty sequence of feature indices (or an int N: the "
                                   f"last N), got {short_repr(out_indices)}", keyword="out_indices")
    if not all(-num_features <= i < num_features for i in out_indices):
        raise InvalidArgumentError(f"out_indices {short_repr(out_indices)} must be from 0 (the stem) to "
                                   f"{num_features - 1} (the last stage), or negative from the end",
                                   keyword="out_indices")
    resolved = [i % num_features for i in out_indices]
    if len(set(resolved)) != len(resolved):
        raise InvalidArgumentError(f"out_indices {short_repr(out_indices)} names a feature map twice",
                                   keyword="out_indices")
    return tuple(sorted(resolved))


class FeatureInfo:
    """What each feature map of a backbone is: timm's ``FeatureInfo`` interface.

    Args:
        info: one dict per feature map of the network, in order, with ``num_chs``, ``reduction``
            and ``module`` (an ``index`` is added).
        out_indices: the maps the backbone returns.

    Attributes:
        info: the dicts, all of them.
        out_indices: the returned maps' indices.
    """

    def __init__(self, info: Sequence[dict[str, Any]], out_indices: Sequence[int]) -> None:
        self.info = [dict(d, index=i) for i, d in enumerate(info)]
        self.out_indices = tuple(out_indices)

    def get(self, key: str, idx: int | Sequence[int] | None = None) -> Any:
        """``key`` of each returned map (``idx=None``), of map ``idx``, or of each map in ``idx``."""
        if idx is None:
            return [self.info[i][key] for i in self.out_indices]
        if isinstance(idx, Sequence):
            return [self.info[i][key] for i in idx]
        return self.info[idx][key]

    def get_dicts(self, keys: Sequence[str] | None = None,
                  idx: int | Sequence[int] | None = None) -> list[dict[str, Any]] | dict[str, Any]:
        """The dicts (restricted to ``keys``) of the returned maps, of map ``idx`` or of the maps in ``idx``."""
        def pick(i: int) -> dict[str, Any]:
            return dict(self.info[i]) if keys is None else {k: self.info[i][k] for k in keys}
        if idx is None:
            return [pick(i) for i in self.out_indices]
        if isinstance(idx, Sequence):
            return [pick(i) for i in idx]
        return pick(idx)

    def channels(self, idx: int | Sequence[int] | None = None) -> Any:
        """Channels of the returned maps (a list), or of map(s) ``idx``."""
        return self.get("num_chs", idx)

    def reduction(self, idx: int | Sequence[int] | None = None) -> Any:
        """Total stride (input size / map size) of the returned maps, or of map(s) ``idx``."""
        return self.get("reduction", idx)

    def module_name(self, idx: int | Sequence[int] | None = None) -> Any:
        """Name of the module that produces each returned map, or map(s) ``idx``."""
        return self.get("module", idx)

    def from_other(self, out_indices: Sequence[int]) -> FeatureInfo:
        """The same maps with other ``out_indices``."""
        return FeatureInfo(copy.deepcopy(self.info), out_indices)

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.info[item]

    def __len__(self) -> int:
        return len(self.info)

    def __repr__(self) -> str:
        return f"FeatureInfo(out_indices={self.out_indices}, channels={self.channels()}, reduction={self.reduction()})"


class ResNetFeatures(nn.Module):
    """A ResNet's stem and stages, returning the feature maps ``out_indices`` (timm's ``features_only``).

    Takes the classifier's modules (no copy) up to the last stage it needs; the head is dropped.
    Freezing (``frozen_stages``, ``norm_eval``) and ``output_stride`` are the classifier's.

    Args:
        model: the classifier, built with the ``output_stride`` and freezing wanted.
        out_indices: feature indices (0: the stem; 1 .. N: the stages), see
            :func:`resolve_out_indices`.

    Attributes:
        feature_info: a :class:`FeatureInfo` of every map, ``out_indices`` those returned.
        spec, output_stride, frozen_stages, norm_eval, input_size: the classifier's.
    """

    def __init__(self, model: ResNet, out_indices: Sequence[int] | int = DEFAULT_OUT_INDICES) -> None:
        super().__init__()
        indices = resolve_out_indices(out_indices, len(model.feature_info))
        self.spec = model.spec
        self.output_stride = model.output_stride
        self.frozen_stages = model.frozen_stages
        self.norm_eval = model.norm_eval
        self.input_size = model.input_size
        self.feature_info = FeatureInfo(model.feature_info, indices)
        self.conv1, self.bn1, self.relu, self.maxpool = model.conv1, model.bn1, model.relu, model.maxpool
        # Stages past the last returned one would only cost time (timm drops them too).
        self.stage_names = model.stage_names[:max(indices)]
        for name in self.stage_names:
            self.add_module(name, getattr(model, name))
        self.train(model.training)

    @property
    def out_indices(self) -> tuple[int, ...]:
        """The indices of the returned feature maps."""
        return self.feature_info.out_indices

    def forward(self, x: Tensor) -> list[Tensor]:
        """The feature maps ``out_indices``, in order: ``[N, channels[i], H / reduction[i], W / reduction[i]]``."""
        wanted = self.out_indices
        out = []
        x = self.relu(self.bn1(self.conv1(x)))
        if 0 in wanted:
            out.append(x)
        x = self.maxpool(x)
        for index, name in enumerate(self.stage_names, start=1):
            x = getattr(self, name)(x)
            if index in wanted:
                out.append(x)
        return out

    def train(self, mode: bool = True) -> ResNetFeatures:
        """Set train or eval mode; frozen stages and, with ``norm_eval``, every BatchNorm stay in eval mode."""
        super().train(mode)
        return set_frozen_modes(self, frozen_stages=self.frozen_stages, norm_eval=self.norm_eval)
