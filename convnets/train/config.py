"""The run configuration of ``convnets train``: one typed dataclass, checked on creation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convnets.train.recipe import LABEL_SMOOTHING, MOMENTUM, WEIGHT_DECAY

__all__ = ["BACKENDS", "TrainConfig", "parse_arch_kwargs"]

#: ``--data-backend`` choices (see :mod:`convnets.train.data`).
BACKENDS = ("pytorch", "dali-cpu", "dali-gpu", "synthetic")


@dataclass
class TrainConfig:
    """Everything a run depends on; defaults are NVIDIA's recipe (see :mod:`convnets.train.recipe`).

    Attributes:
        data: directory with ``train/<class>/*`` and ``val/<class>/*`` (ImageFolder layout);
            not needed with ``data_backend="synthetic"``.
        output: directory for ``checkpoint.pth.tar``, ``model_best.pth.tar`` and ``metrics.jsonl``
            (not needed with ``evaluate``).
        arch: a registered model name (:func:`convnets.list_models`).
        arch_kwargs: architecture overrides for :func:`convnets.get_model`, e.g.
            ``{"layers": [1, 1, 1, 1], "widths": [32, 64, 128, 256]}``.
        pretrained: start from NVIDIA's ImageNet weights (head replaced for the data's classes).
        pretrained_from_file: start from the weights in this checkpoint instead.
        epochs: training epochs.
        batch_size: images per process and micro-step.
        grad_accum: micro-steps per optimizer step; the optimizer batch is
            ``batch_size x processes x grad_accum``.
        lr: peak learning rate; ``None``: 0.256 x optimizer batch / 256.
        warmup_epochs: linear warmup length; ``None``: 0 below an optimizer batch of 512, else
            8 epochs but at most a tenth of the run (see ``recipe.default_warmup_epochs``).
        momentum, weight_decay, label_smoothing: SGD momentum, decay of conv / linear weights,
            label smoothing of the loss.
        mixup: MixUp alpha (0: off; upstream uses 0.2 for 250-epoch runs).
        ema: decay of an exponential moving average of the weights (``None``: off), e.g. 0.9999.
        image_size: training and validation crop size.
        amp: autocast on/off; ``None``: where it helps (CUDA; CPUs with native bf16).
        amp_dtype: ``"fp16"`` (CUDA default, with a GradScaler) or ``"bf16"``.
        memory_format: ``"nhwc"`` or ``"nchw"``; ``None``: NHWC under AMP, else NCHW.
        data_backend: ``"pytorch"``, ``"dali-cpu"``, ``"dali-gpu"`` or ``"synthetic"``.
        workers: data-loader processes (pytorch) or decoding threads (DALI) per training process.
        device: ``"cuda"``, ``"cpu"`` or ``None`` (CUDA when available).
        seed: seed of initialisation, data order and augmentation.
        resume: continue from this training checkpoint.
        evaluate: only validate the weights of ``resume`` / ``pretrained*``.
        progress: show a progress bar per epoch (rank 0, stderr).
        max_nonfinite_steps: stop after this many optimizer steps in a row skipped for a
            non-finite loss or gradient.
    """

    data: Path | None = None
    output: Path | None = None
    arch: str = "resnet50"
    arch_kwargs: dict[str, Any] = field(default_factory=dict)
    pretrained: bool = False
    pretrained_from_file: Path | None = None
    epochs: int = 90
    batch_size: int = 128
    grad_accum: int = 1
    lr: float | None = None
    warmup_epochs: float | None = None
    momentum: float = MOMENTUM
    weight_decay: float = WEIGHT_DECAY
    label_smoothing: float = LABEL_SMOOTHING
    mixup: float = 0.0
    ema: float | None = None
    image_size: int = 224
    amp: bool | None = None
    amp_dtype: str | None = None
    memory_format: str | None = None
    data_backend: str = "pytorch"
    workers: int = 4
    device: str | None = None
    seed: int = 0
    resume: Path | None = None
    evaluate: bool = False
    progress: bool = True
    max_nonfinite_steps: int = 10

    def __post_init__(self) -> None:
        for name in ("data", "output", "pretrained_from_file", "resume"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))
        self.arch_kwargs = dict(self.arch_kwargs)
        problems = []
        for name in ("epochs", "batch_size", "grad_accum", "image_size", "max_nonfinite_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("workers", "seed"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                problems.append(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        for name, value, ok in (
            ("lr", self.lr, self.lr is None or (math.isfinite(self.lr) and self.lr > 0)),
            ("warmup_epochs", self.warmup_epochs, self.warmup_epochs is None or 0 <= self.warmup_epochs <= self.epochs),
            ("momentum", self.momentum, 0 <= self.momentum < 1),
            ("weight_decay", self.weight_decay, self.weight_decay >= 0),
            ("label_smoothing", self.label_smoothing, 0 <= self.label_smoothing < 1),
            ("mixup", self.mixup, self.mixup >= 0),
            ("ema", self.ema, self.ema is None or 0 < self.ema < 1),
        ):
            if not ok:
                problems.append(f"{name} is out of range: {value!r}")
        if self.data_backend not in BACKENDS:
            problems.append(f"data_backend must be one of {', '.join(BACKENDS)}, got {self.data_backend!r}")
        if self.data_backend != "synthetic" and self.data is None:
            problems.append(f"data (--data DIR) is required with the {self.data_backend} backend")
        if self.evaluate:
            if self.resume is None and not self.pretrained and self.pretrained_from_file is None:
                problems.append("evaluate needs weights: --resume CHECKPOINT, --pretrained or --pretrained-from-file")
        elif self.output is None:
            problems.append("output (--output DIR) is required for training")
        if problems:
            raise ValueError("invalid training configuration: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (paths as strings), for checkpoints and logs."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}


def parse_arch_kwargs(text: str) -> dict[str, Any]:
    """``--arch-kwargs`` JSON: forwards to :func:`convnets.commands.options.parse_arch_kwargs`, its home.

    Kept only for ``convnets/commands/train.py`` until it adds the option with
    ``options.add_arch_kwargs_argument``; then delete this function (an upward import).

    Raises:
        InvalidArgumentError: not JSON, or not an object (a ``ValueError``).
    """
    from convnets.commands.options import parse_arch_kwargs as parse

    return parse(text)
