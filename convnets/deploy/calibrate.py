"""BatchNorm statistics for randomly initialised models, so that their activations stay in range.

Used by the command line's ``--random-init`` (:mod:`convnets.commands.options`) and by tests that
need a random network which behaves numerically like a trained one.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["calibrate_batchnorm"]


def calibrate_batchnorm(model: nn.Module, *, image_size: int = 224, batch_size: int = 8, batches: int = 2) -> None:
    """Give every BatchNorm the running statistics of random normal inputs; leaves eval mode.

    A freshly initialised network's BatchNorms are identities (mean 0, variance 1), so activations
    grow block after block: in SE-ResNeXt101 the logits reach thousands, float32 itself is off
    by 6e-4 relative to float64, and fp16 overflows. With measured statistics the activations stay
    in range as in a trained network, so export verification and reduced precision behave as they
    would with real weights.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    generator = torch.Generator().manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch_size, 3, image_size, image_size, generator=generator))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()
