"""NVIDIA's ConvNets training recipe as small, separately testable pieces.

Source of the recipe: https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets
(README "Default configuration" and "Optimizer"): SGD with momentum 0.875, learning rate 0.256 per
256 images of global batch, cosine schedule with linear warmup, weight decay 1/16384 on
convolution and linear weights only, label smoothing 0.1, optional MixUp, optional EMA of weights,
mixed precision with dynamic loss scaling (initial scale 128) and channels-last layout.

Multi-label fine-tuning (``--multilabel``) keeps all of it and replaces the loss with
:class:`MultiLabelLoss` (``BCEWithLogitsLoss`` on multi-hot targets).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor, nn

from convnets.errors import InvalidArgumentError, InvalidArgumentTypeError
from convnets.train.config import BASE_LR_PER_256, LABEL_SMOOTHING, MOMENTUM, WEIGHT_DECAY

__all__ = [
    "BASE_LR_PER_256",
    "LABEL_SMOOTHING",
    "MOMENTUM",
    "MultiLabelLoss",
    "WEIGHT_DECAY",
    "default_warmup_epochs",
    "lr_at",
    "make_ema",
    "make_optimizer",
    "make_scheduler",
    "mixup",
    "param_groups",
    "scaled_lr",
]

WARMUP_MIN_BATCH = 512  # upstream warms up only from this global batch on
WARMUP_EPOCHS_LARGE_BATCH = 8.0


def scaled_lr(global_batch: int) -> float:
    """Linear scaling rule: 0.256 per 256 images of the *optimizer* batch.

    Args:
        global_batch: images per optimizer step over all processes, i.e. per-process batch x
            processes x gradient-accumulation steps.
    """
    return BASE_LR_PER_256 * global_batch / 256


def default_warmup_epochs(global_batch: int, epochs: int) -> float:
    """Upstream warms up for a few epochs only for global batches of 512 and more.

    Returns 0 below 512 images; otherwise 8 epochs (upstream's warmup for its 90- and 250-epoch
    runs), but at most a tenth of the run so that short fine-tuning runs are not all warmup.
    """
    if global_batch < WARMUP_MIN_BATCH:
        return 0.0
    return min(WARMUP_EPOCHS_LARGE_BATCH, epochs / 10)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Two SGD parameter groups: conv / linear weights decay, everything else does not.

    Upstream excludes BN parameters by name and so still decays the downsample BN
    (``downsample.1``), the SE biases and ``fc.bias``; classifying by module type avoids that.

    Raises:
        InvalidArgumentTypeError: the model has trainable parameters in a layer type this recipe
            does not know (a ``TypeError``).
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, (nn.Conv2d, nn.Linear)) and name == "weight":
                decay.append(p)
            elif isinstance(module, (nn.Conv2d, nn.Linear, nn.modules.batchnorm._NormBase)):
                no_decay.append(p)  # biases, BN gamma and beta
            else:
                raise InvalidArgumentTypeError(f"no weight-decay rule for parameter {module_name}.{name} of a "
                                               f"{type(module).__name__}")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: nn.Module, lr: float, *, momentum: float = MOMENTUM,
                   weight_decay: float = WEIGHT_DECAY) -> torch.optim.SGD:
    """SGD with momentum and weight decay on conv / linear weights only (see :func:`param_groups`)."""
    return torch.optim.SGD(param_groups(model, weight_decay), lr=lr, momentum=momentum)


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then half a cosine.

    Warmup reaches ``base_lr`` at the end of step ``warmup_steps - 1``; the cosine then falls from
    ``base_lr`` towards 0 over the remaining steps.
    """
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that follows :func:`lr_at`; call ``.step()`` once per optimizer step.

    The lambda is a ``functools.partial`` with no state of its own, so a resumed run follows the
    schedule of its current configuration (e.g. more epochs) from the restored step count.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_at, base_lr=1.0, warmup_steps=warmup_steps, total_steps=total_steps))


def mixup(images: Tensor, targets: Tensor, alpha: float,
          rng: np.random.Generator) -> tuple[Tensor, Tensor, Tensor, float]:
    """MixUp (https://arxiv.org/abs/1710.09412): blend each image with another of the batch.

    Args:
        images: a normalised batch ``[N, C, H, W]``.
        targets: class indices ``[N]`` (or multi-hot rows ``[N, C]``: see :class:`MultiLabelLoss`).
        alpha: Beta(alpha, alpha) parameter of the mixing weight (upstream: 0.2).
        rng: source of the mixing weight and of the pairing, seeded per epoch for exact resume.

    Returns:
        ``(mixed, targets_a, targets_b, lam)``; the loss is
        ``lam * loss(out, targets_a) + (1 - lam) * loss(out, targets_b)``.
    """
    lam = float(rng.beta(alpha, alpha))
    perm = torch.from_numpy(rng.permutation(images.shape[0])).to(images.device)
    mixed = images.mul(lam).add_(images[perm], alpha=1.0 - lam)
    return mixed, targets, targets[perm], lam


class MultiLabelLoss(nn.Module):
    """The multi-label loss: ``BCEWithLogitsLoss`` (mean over images and classes) on multi-hot targets.

    Label smoothing is reinterpreted for independent classes as timm's ``BinaryCrossEntropy`` does: a
    target ``t`` becomes ``t * (1 - s) + s / C`` (``C`` classes), so a label's target is ``1 - s + s / C``
    and an absent one's ``s / C``, the probabilities that cross-entropy's smoothing gives a one-hot target.
    The loss is linear in the target, so MixUp's ``lam * loss(a) + (1 - lam) * loss(b)`` is the loss of the
    mixed multi-hot target ``lam * a + (1 - lam) * b``.

    Args:
        label_smoothing: ``s``, from 0 (off) to below 1.
    """

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The mean loss of ``logits`` ``[N, C]`` against multi-hot ``targets`` ``[N, C]`` (computed in float32)."""
        t = targets.float()
        if self.label_smoothing:
            t = t * (1 - self.label_smoothing) + self.label_smoothing / t.shape[1]
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), t)


def make_ema(model: nn.Module, decay: float) -> torch.optim.swa_utils.AveragedModel:
    """An exponential moving average of the weights *and* BN statistics, as upstream keeps.

    ``ema.update_parameters(model)`` after each optimizer step; the first call copies the model.
    """
    return torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(decay), use_buffers=True)
