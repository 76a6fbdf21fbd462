"""BatchNorm folding: each BatchNorm that follows a convolution becomes part of that convolution.

Shared by every inference engine (:mod:`convnets.deploy.engines`) and by the exports
(:mod:`convnets.deploy.export`): all of them run or write the folded network.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from convnets.errors import InvalidArgumentError
from convnets.models.resnet import Bottleneck, ResNet

__all__ = ["error_summary", "fold_batchnorm"]

log = logging.getLogger(__name__)

# (convolution, BatchNorm) attribute pairs where the forward pass applies the BatchNorm directly to
# the convolution's output; only then is folding exact. nn.Sequential is handled by position.
_CONV_BN_PAIRS: dict[type, tuple[tuple[str, str], ...]] = {
    ResNet: (("conv1", "bn1"),),
    Bottleneck: (("conv1", "bn1"), ("conv2", "bn2"), ("conv3", "bn3")),
}


def error_summary(error: BaseException) -> str:
    """``"Type: first line of the message"``, for one-line reports of long library errors."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _folded_conv(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """``conv`` followed by eval-mode ``bn`` as one convolution with a bias.

    Same algebra as :func:`torch.nn.utils.fusion.fuse_conv_bn_eval`, but computed in float64 so
    that the folded weights are the correctly rounded float32 values rather than the product of
    three float32 roundings.
    """
    # On the CPU: float64 is not available on every accelerator (e.g. MPS); this runs once.
    def acc(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device="cpu", dtype=torch.float64)

    w = acc(conv.weight)
    b = acc(conv.bias) if conv.bias is not None else torch.zeros(w.shape[0], device="cpu", dtype=torch.float64)
    gamma = acc(bn.weight) if bn.weight is not None else torch.ones_like(b)
    beta = acc(bn.bias) if bn.bias is not None else torch.zeros_like(b)
    assert bn.running_mean is not None and bn.running_var is not None  # checked by _foldable
    scale = gamma * torch.rsqrt(acc(bn.running_var) + bn.eps)
    weight = w * scale.reshape(-1, 1, 1, 1)
    bias = (b - acc(bn.running_mean)) * scale + beta
    fused = copy.deepcopy(conv)
    fused.weight = nn.Parameter(weight.to(device=conv.weight.device, dtype=conv.weight.dtype), requires_grad=False)
    fused.bias = nn.Parameter(bias.to(device=conv.weight.device, dtype=conv.weight.dtype), requires_grad=False)
    return fused


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    # A BatchNorm without running statistics normalises with batch statistics even in eval mode.
    return (type(conv) is nn.Conv2d and isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None
            and bn.running_var is not None and bn.num_features == conv.out_channels)


def fold_batchnorm(model: nn.Module) -> nn.Module:
    """Fold every BatchNorm that directly follows a convolution into that convolution, in place.

    Knows the pairs in :class:`~convnets.models.resnet.ResNet` and its blocks, and consecutive
    ``Conv2d, BatchNorm2d`` children of any ``nn.Sequential`` (e.g. the downsample branches).
    Each folded BatchNorm is replaced by ``nn.Identity``; any BatchNorm left (in modules this
    function does not know) still works in eval mode and is reported in the log.

    Args:
        model: a model in eval mode (folding uses the running statistics). Modified in place.

    Returns:
        ``model``, for chaining.
    """
    if model.training:
        raise InvalidArgumentError("fold_batchnorm needs a model in eval mode (call model.eval() first); "
                                   "folding replaces BatchNorm's batch statistics with its running statistics")
    folded = 0
    for module in list(model.modules()):
        pairs: list[tuple[str, str]] = []
        for cls, names in _CONV_BN_PAIRS.items():
            if isinstance(module, cls):
                pairs.extend(names)
        if isinstance(module, nn.Sequential):
            keys = list(module._modules)
            pairs.extend(zip(keys, keys[1:]))
        for conv_name, bn_name in pairs:
            conv, bn = getattr(module, conv_name, None), getattr(module, bn_name, None)
            if conv is not None and bn is not None and _foldable(conv, bn):
                setattr(module, conv_name, _folded_conv(conv, bn))
                setattr(module, bn_name, nn.Identity())
                folded += 1
    left = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    log.debug("folded %d BatchNorm layers into convolutions", folded)
    if left:
        log.info("%d BatchNorm layers could not be folded (unknown module structure); they run as they are", left)
    return model
