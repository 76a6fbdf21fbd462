"""The ResNet v1.5 family as NVIDIA trains it: ResNet-50, ResNeXt101-32x4d, SE-ResNeXt101-32x4d.

One network definition driven by an :class:`ArchSpec`; the three published models differ only in
their spec (:data:`MODEL_SPECS`). Parameter names follow the NGC 20.06 checkpoints (``conv1``,
``bn1``, ``layer1`` .. ``layer4``, ``fc``; SE weights under ``.squeeze.squeeze`` and
``.squeeze.expand``), which is also torchvision's and timm's naming, so those state dicts load as is.

References:
    ResNet: https://arxiv.org/abs/1512.03385 (v1.5: the stride sits on the 3x3 conv)
    ResNeXt: https://arxiv.org/abs/1611.05431
    SE: https://arxiv.org/abs/1709.01507 (NVIDIA's variant, see :class:`SqueezeExcitation`)
    Upstream: https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from convnets.errors import InvalidArgumentError, short_repr
from convnets.models.specs import ARCH_FIELDS, MODEL_SPECS, ArchSpec, registered_name

__all__ = ["ARCH_FIELDS", "ArchSpec", "Bottleneck", "MODEL_SPECS", "OUTPUT_STRIDES", "ResNet", "SqueezeExcitation",
           "check_backbone_options", "count_parameters", "freeze_batchnorm", "registered_name", "set_frozen_modes"]

#: Reductions of the last feature map that ``output_stride`` may ask for (timm's and torchvision's choices).
OUTPUT_STRIDES: tuple[int, ...] = (8, 16, 32)

_M = TypeVar("_M", bound=nn.Module)


class SqueezeExcitation(nn.Module):
    """NVIDIA's squeeze-and-excitation gate: ``sigmoid(expand(relu(squeeze(mean_hw(x)))))``.

    Unlike the SE paper (and timm), the hidden width is a fixed number of channels, not C/16, and
    the two projections are ``nn.Linear`` layers (2-D weights, as in the NGC 20.06 checkpoints).
    Returns the gate shaped ``[N, C, 1, 1]``; the block applies it.
    """

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.squeeze = nn.Linear(channels, squeeze)
        self.expand = nn.Linear(squeeze, channels)

    def forward(self, x: Tensor) -> Tensor:
        s = x.mean(dim=(2, 3))
        s = torch.relu(self.squeeze(s))
        s = torch.sigmoid(self.expand(s))
        return s[:, :, None, None]


class Bottleneck(nn.Module):
    """1x1 reduce -> grouped 3x3 (carries the stride) -> 1x1 expand, optional SE, residual add.

    With SE the output is ``relu(residual + out * gate)``; upstream computes it with
    ``torch.addcmul`` (``fused_se=True``), which is also what we do by default. ``dilation`` spaces
    the 3x3 convolution's taps (``output_stride`` below 32); it changes no weight.
    """

    def __init__(
        self,
        in_channels: int,
        width: int,
        expansion: int,
        stride: int = 1,
        cardinality: int = 1,
        se_squeeze: int | None = None,
        fused_se: bool = True,
        dilation: int = 1,
    ) -> None:
        super().__init__()
        out_channels = width * expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=dilation, dilation=dilation, groups=cardinality,
                               bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        self.squeeze = SqueezeExcitation(out_channels, se_squeeze) if se_squeeze else None
        self.fused_se = fused_se

    def forward(self, x: Tensor) -> Tensor:
        residual = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.squeeze is None:
            out = out + residual
        elif self.fused_se:
            out = torch.addcmul(residual, out, self.squeeze(out))
        else:
            out = residual + out * self.squeeze(out)
        return self.relu(out)


class ResNet(nn.Module):
    """A ResNet v1.5 / ResNeXt / SE-ResNeXt classifier built from an :class:`ArchSpec`.

    Args:
        spec: the architecture.
        num_classes: outputs of the final linear layer (0: no classifier, ``forward`` returns
            pooled features).
        last_bn_0_init: start every block's last BatchNorm at gamma 0 (upstream option).
        conv_init: ``"fan_in"`` or ``"fan_out"`` mode of the Kaiming-normal convolution init.
        fused_se: compute the SE residual with ``torch.addcmul`` (same result, upstream option).
        output_stride: 32 (the published network), 16 or 8: the last stages keep their input's
            resolution and dilate their 3x3 convolutions instead of striding, as timm's
            ``output_stride`` and torchvision's ``replace_stride_with_dilation`` do (the first
            block of a dilated stage keeps the previous dilation). The weights are the same.
        frozen_stages: mmdetection's meaning: -1 freezes nothing, 0 the stem (``conv1``, ``bn1``),
            N the stem and the first N stages. Frozen parameters get ``requires_grad=False`` and
            the frozen modules stay in eval mode when the model is put in train mode.
        norm_eval: keep every BatchNorm in eval mode (running statistics fixed) when the model
            is put in train mode (mmdetection's ``norm_eval``); their affine terms still train.

    Attributes:
        feature_info: what each feature map is, as in timm: a dict per map (``num_chs``,
            ``reduction``, ``module``), the stem's output (before max pooling) first, then each
            stage's.
    """

    def __init__(
        self,
        spec: ArchSpec,
        num_classes: int = 1000,
        *,
        last_bn_0_init: bool = False,
        conv_init: Literal["fan_in", "fan_out"] = "fan_in",
        fused_se: bool = True,
        output_stride: int = 32,
        frozen_stages: int = -1,
        norm_eval: bool = False,
    ) -> None:
        super().__init__()
        if conv_init not in ("fan_in", "fan_out"):
            raise InvalidArgumentError(f"conv_init must be 'fan_in' or 'fan_out', got {conv_init!r}")
        if not isinstance(num_classes, int) or num_classes < 0:
            raise InvalidArgumentError(f"num_classes must be a non-negative integer, got {num_classes!r}")
        check_backbone_options(spec, output_stride=output_stride, frozen_stages=frozen_stages, norm_eval=norm_eval)
        self.spec = spec
        self.num_features = spec.num_features
        self.output_stride = output_stride
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.conv1 = nn.Conv2d(3, spec.stem_width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(spec.stem_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_channels = spec.stem_width
        self.stage_names: tuple[str, ...] = tuple(f"layer{i + 1}" for i in range(len(spec.layers)))
        self.feature_info: list[dict[str, Any]] = [dict(num_chs=spec.stem_width, reduction=2, module="relu")]
        reduction, dilation = 4, 1  # after the stem
        for i, (name, blocks, width) in enumerate(zip(self.stage_names, spec.layers, spec.widths)):
            stride, previous_dilation = (1 if i == 0 else 2), dilation
            if reduction >= output_stride:  # dilate instead of striding, as timm's make_blocks does
                dilation, stride = dilation * stride, 1
            reduction *= stride
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(in_channels, width, spec.expansion, stride if b == 0 else 1, spec.cardinality,
                                        spec.se_squeeze, fused_se, dilation=previous_dilation if b == 0 else dilation))
                in_channels = width * spec.expansion
            self.add_module(name, nn.Sequential(*stage))
            self.feature_info.append(dict(num_chs=in_channels, reduction=reduction, module=name))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.num_classes = num_classes
        #: Names of the classifier's outputs when a checkpoint provides them (see load_model).
        self.class_names: list[str] | None = None
        #: Center-crop size the weights were trained for (a training checkpoint records it);
        #: ``convnets predict`` preprocesses to it.
        self.input_size: int = 224
        #: A multi-label classifier (``convnets train --multilabel``): a sigmoid per class, and the labels
        #: whose probability reaches their ``thresholds`` entry, instead of a softmax over the classes.
        self.multilabel: bool = False
        #: The per-class decision thresholds of a multi-label classifier (chosen on its validation set).
        self.thresholds: list[float] | None = None
        self.fc: nn.Module = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self._init_weights(conv_init, last_bn_0_init)
        set_frozen_modes(self, frozen_stages=frozen_stages, norm_eval=norm_eval)

    def train(self, mode: bool = True) -> ResNet:
        """Set train or eval mode; frozen stages (``frozen_stages``) and, with ``norm_eval``, every
        BatchNorm stay in eval mode."""
        super().train(mode)
        return set_frozen_modes(self, frozen_stages=self.frozen_stages, norm_eval=self.norm_eval)

    def decision_thresholds(self) -> list[float] | None:
        """A multi-label classifier's per-class thresholds (0.5 for a checkpoint that stores none); ``None``
        for a single-label one (a softmax)."""
        return (self.thresholds or [0.5] * self.num_classes) if self.multilabel else None

    def _init_weights(self, conv_init: Literal["fan_in", "fan_out"], last_bn_0_init: bool) -> None:
        if self.conv1.weight.is_meta:
            # Built to receive a checkpoint's tensors; besides, normal_ has no meta kernel and its
            # fallback imports torch's decomposition machinery, ~1.3 s of a pretrained load.
            return
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode=conv_init, nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if last_bn_0_init:
            # Each block then starts as the identity, which helps large-batch training.
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def stages(self) -> list[nn.Sequential]:
        """The residual stages ``layer1`` .. ``layerN`` in order."""
        return [getattr(self, name) for name in self.stage_names]

    def stem(self, x: Tensor) -> Tensor:
        """7x7/2 convolution, BatchNorm, ReLU and 3x3/2 max pooling."""
        return self.maxpool(self.relu(self.bn1(self.conv1(x))))

    def forward_features(self, x: Tensor) -> Tensor:
        """The unpooled feature map of the last stage, ``[N, num_features, H/32, W/32]`` (timm API)."""
        x = self.stem(x)
        for stage in self.stages():
            x = stage(x)
        return x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Global average pooling then the classifier; ``pre_logits=True`` stops before it (timm API)."""
        x = torch.flatten(self.avgpool(x), 1)
        return x if pre_logits else self.fc(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def classifier(self, x: Tensor) -> Tensor:
        """Pool and classify a last-stage feature map (upstream's name for :meth:`forward_head`)."""
        return self.forward_head(x)

    def extract_features(self, x: Tensor, layers: Iterable[str] | None = None) -> dict[str, Tensor]:
        """Upstream's transfer-learning helper: outputs of chosen stages and/or the classifier.

        Args:
            x: an input batch ``[N, 3, H, W]``.
            layers: names among ``"layer1"`` .. ``"layer4"`` and ``"classifier"`` (logits);
                ``None`` returns all of them. Only the stages needed are run.

        Returns:
            A dict from each requested name to its tensor.
        """
        valid = (*self.stage_names, "classifier")
        wanted = list(valid) if layers is None else list(layers)
        unknown = [name for name in wanted if name not in valid]
        if unknown:
            raise InvalidArgumentError(f"unknown layer name(s) {unknown}; choose from {list(valid)}")
        last = len(self.stage_names) if "classifier" in wanted else max(
            (self.stage_names.index(n) + 1 for n in wanted), default=0)
        out: dict[str, Tensor] = {}
        if last == 0:
            return out
        x = self.stem(x)
        for name, stage in zip(self.stage_names[:last], self.stages()):
            x = stage(x)
            if name in wanted:
                out[name] = x
        if "classifier" in wanted:
            out["classifier"] = self.forward_head(x)
        return out

    def get_classifier(self) -> nn.Module:
        """The final linear layer (timm API)."""
        return self.fc

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head with a freshly initialised one of ``num_classes`` outputs (0: none).

        The new layer is created on the device and dtype of the backbone.
        """
        if not isinstance(num_classes, int) or num_classes < 0:
            raise InvalidArgumentError(f"num_classes must be a non-negative integer, got {num_classes!r}")
        ref = self.conv1.weight
        self.num_classes = num_classes
        self.fc = (nn.Linear(self.num_features, num_classes, device=ref.device, dtype=ref.dtype)
                   if num_classes else nn.Identity())


def check_backbone_options(spec: ArchSpec, *, output_stride: object = 32, frozen_stages: object = -1,
                           norm_eval: object = False) -> None:
    """Raise :class:`InvalidArgumentError` unless these are valid :class:`ResNet` options for ``spec``.

    Called before any weights are fetched, so that a mistaken value costs no download.
    """
    if isinstance(output_stride, bool) or output_stride not in OUTPUT_STRIDES:
        raise InvalidArgumentError(f"output_stride must be one of {', '.join(map(str, OUTPUT_STRIDES))}, got "
                                   f"{short_repr(output_stride)}", keyword="output_stride")
    stages = len(spec.layers)
    if isinstance(frozen_stages, bool) or not isinstance(frozen_stages, int) or not -1 <= frozen_stages <= stages:
        raise InvalidArgumentError(f"frozen_stages must be an integer from -1 (nothing frozen) to {stages} (every "
                                   f"stage), got {short_repr(frozen_stages)}", keyword="frozen_stages")
    if not isinstance(norm_eval, bool):
        raise InvalidArgumentError(f"norm_eval must be True or False, got {short_repr(norm_eval)}",
                                   keyword="norm_eval")


def set_frozen_modes(module: _M, *, frozen_stages: int, norm_eval: bool) -> _M:
    """Freeze as mmdetection's ResNet does: the stem and the first ``frozen_stages`` stages get
    ``requires_grad=False`` and eval mode; with ``norm_eval`` every BatchNorm goes to eval mode too.

    Args:
        module: a :class:`ResNet`, or a module with its children (``conv1``, ``bn1``, ``layer1``, ...).
        frozen_stages: -1: nothing; 0: the stem; N: the stem and ``layer1`` .. ``layerN``.
        norm_eval: whether BatchNorm statistics stay fixed in train mode.

    Returns:
        ``module``.
    """
    if frozen_stages >= 0:
        # A features-only model may stop before the last frozen stage: it has no such child.
        names = ("conv1", "bn1", *(f"layer{i}" for i in range(1, frozen_stages + 1)))
        for part in (getattr(module, name) for name in names if hasattr(module, name)):
            part.eval()
            part.requires_grad_(False)
    if norm_eval and module.training:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return module


def freeze_batchnorm(module: _M) -> _M:
    """Replace every ``BatchNorm2d`` of ``module`` with torchvision's ``FrozenBatchNorm2d`` (in place).

    The frozen layer keeps the statistics and affine terms as buffers (no gradient, no update in
    train mode), as torchvision's detection backbones and detectron2's ``FrozenBN`` do.

    Returns:
        ``module``.
    """
    from torchvision.ops import FrozenBatchNorm2d

    def convert(bn: nn.BatchNorm2d) -> nn.Module:
        frozen = FrozenBatchNorm2d(bn.num_features, eps=bn.eps).to(bn.weight.device)
        with torch.no_grad():
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(frozen, name).copy_(getattr(bn, name))
        return frozen

    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, convert(child))
        else:
            freeze_batchnorm(child)
    return module


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (trainable ones only if asked)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
