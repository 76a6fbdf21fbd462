"""Calibration: BatchNorm statistics for random models, and the images int8 quantization is calibrated on.

:func:`calibrate_batchnorm` is used by the command line's ``--random-init``
(:mod:`convnets.commands.model_options`) and by tests that need a random network which behaves
numerically like a trained one. :func:`calibration_batches` checks and normalises
``optimize_for_inference(precision="int8", calibration_data=...)``, and :func:`split_calibration`
divides those images between the quantizer and the check of its result.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from convnets.errors import InvalidArgumentError

__all__ = ["CALIBRATION_IMAGES", "CHECK_IMAGES", "CalibrationData", "calibrate_batchnorm", "calibration_batches",
           "split_calibration"]

#: What ``calibration_data`` may be: one ``[N, 3, H, W]`` batch, or an iterable of such batches
#: (or of ``(images, targets)`` pairs, as a ``DataLoader`` over a labelled data set yields).
CalibrationData = Tensor | Iterable[Tensor] | Iterable[tuple[Tensor, ...]]

#: int8: at most this many of the given images calibrate the quantizer (NNCF's default subset)...
CALIBRATION_IMAGES = 300
#: ... and at most this many others, which it never saw, check the result (99% agreement on 300
#: images allows three disagreements; on 64 it would allow none).
CHECK_IMAGES = 300


def calibration_batches(data: CalibrationData | None, *, keyword: str = "calibration_data") -> list[Tensor]:
    """``data`` as a list of float32 CPU ``[n, 3, H, W]`` batches, all of one image size.

    Args:
        data: preprocessed images as the model takes them (normalised, NCHW): a tensor, or an
            iterable of tensors or of tuples whose first item is the images.
        keyword: how the caller's interface names ``data``, for the messages.

    Raises:
        InvalidArgumentError: ``data`` is missing or empty, not image batches, or of mixed image sizes.
    """
    if data is None:
        raise InvalidArgumentError(f"precision='int8' needs {keyword}: a few hundred preprocessed images "
                                   "([N, 3, H, W] tensor, or an iterable of such batches) like those the model "
                                   "will see, to calibrate the quantization ranges on", keyword=keyword)
    items = [data] if isinstance(data, Tensor) else data
    if not isinstance(items, Iterable):
        raise InvalidArgumentError(f"{keyword} must be an [N, 3, H, W] tensor or an iterable of such batches, "
                                   f"not {type(data).__name__}", keyword=keyword)
    batches: list[Tensor] = []
    for item in items:
        if isinstance(item, (tuple, list)) and item:
            item = item[0]  # (images, targets) from a labelled loader
        if not isinstance(item, Tensor) or item.dim() != 4 or item.shape[1] != 3 or not item.is_floating_point():
            what = f"a {tuple(item.shape)} {item.dtype} tensor" if isinstance(item, Tensor) else type(item).__name__
            raise InvalidArgumentError(f"{keyword} must hold float [N, 3, H, W] image batches (preprocessed as "
                                       f"for the model), got {what}", keyword=keyword)
        if batches and item.shape[2:] != batches[0].shape[2:]:
            raise InvalidArgumentError(f"{keyword} mixes image sizes ({tuple(batches[0].shape[2:])} and "
                                       f"{tuple(item.shape[2:])}); the int8 graph is calibrated for one size",
                                       keyword=keyword)
        if len(item):
            batches.append(item.detach().to(device="cpu", dtype=torch.float32).contiguous())
    if not batches:
        raise InvalidArgumentError(f"{keyword} holds no images", keyword=keyword)
    return batches


def split_calibration(batches: list[Tensor], *, keyword: str = "calibration_data") -> tuple[list[Tensor], Tensor]:
    """The images to calibrate on, and the held-out images that check the quantized model.

    Agreement measured on the images the quantizer calibrated on overestimates the agreement on
    images it has not seen (tests/test_int8.py measured 99.3% against 98.7% for the same model), so
    the check runs on images held out of calibration: a seeded random half of the images (at most
    :data:`CHECK_IMAGES`), the rest (at most :data:`CALIBRATION_IMAGES`) calibrate. Random, not
    every other one, so that images sorted by class give both halves every class.

    Args:
        batches: what :func:`calibration_batches` returns.
        keyword: how the caller's interface names the images, for the message.

    Returns:
        ``(calibrate, held_out)``: batches of the images to calibrate on (in their given order),
        and one ``[n, 3, H, W]`` tensor of the held-out ones.

    Raises:
        InvalidArgumentError: fewer than two images.
    """
    images = torch.cat(batches)
    if len(images) < 2:
        raise InvalidArgumentError(f"{keyword} holds 1 image; int8 needs at least 2 (a few hundred are best): half "
                                   "calibrate the quantizer, the other half check its answers on images it has not "
                                   "seen", keyword=keyword)
    held = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:min(CHECK_IMAGES, len(images) // 2)]
    calibrate = torch.ones(len(images), dtype=torch.bool)
    calibrate[held] = False
    return list(images[calibrate][:CALIBRATION_IMAGES].split(32)), images[held.sort().values]


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
