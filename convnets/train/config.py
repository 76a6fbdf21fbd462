"""The run configuration of ``convnets train``: one typed dataclass, checked on creation.

Each field also describes its command-line flag, in ``dataclasses.field(metadata=option(...))``;
:mod:`convnets.commands.train` builds every flag from these, so a new hyperparameter is one field
here plus the code that uses it. The metadata keys (see :func:`option`):

``help`` (argparse help, ``%(default)s`` allowed), ``group`` (help section), ``metavar``,
``choices``, ``parse`` (a ``str -> value`` function for a type that the annotation alone does not
say, e.g. JSON; its ``ValueError`` becomes a usage error) and ``shared`` (the name of a shared
command-line option to use instead of a generated one: ``--model``, ``--weights``, ``--precision``,
``--device``, ... as every command spells and parses them, with this field's default and help; see
``convnets.commands.train``). The flag is ``--field-name``; a ``bool``
field that defaults to ``True`` gets ``--no-field-name``, a ``bool | None`` field both spellings.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from convnets.constants import BACKENDS, DEFAULT_IMAGE_SIZE
from convnets.errors import InvalidArgumentError
from convnets.models.specs import list_models

__all__ = ["BACKENDS", "BASE_LR_PER_256", "LABEL_SMOOTHING", "MOMENTUM", "OPTION_GROUPS", "TrainConfig", "WEIGHT_DECAY",
           "flag_name", "option"]

# NVIDIA's recipe numbers (README "Default configuration"; convnets.train.recipe applies them). They
# live here, with no PyTorch import, because they are TrainConfig's defaults and `convnets train
# --help` shows them without importing PyTorch.
BASE_LR_PER_256 = 0.256
MOMENTUM = 0.875
WEIGHT_DECAY = 1.0 / 16384  # 6.103515625e-05
LABEL_SMOOTHING = 0.1


#: The sections of ``convnets train --help``, in this order.
DATA, MODEL, RECIPE, DEVICES, RUN = OPTION_GROUPS = (
    "data and output", "model", "recipe", "precision and devices", "run")


def option(help: str, group: str, *, metavar: str | None = None, choices: Sequence[str] | None = None,
           parse: Callable[[str], Any] | None = None, shared: str | None = None) -> dict[str, Any]:
    """The metadata that makes a :class:`TrainConfig` field a ``convnets train`` flag.

    Args:
        help: help text (``%(default)s`` shows the default).
        group: one of :data:`OPTION_GROUPS`.
        metavar: placeholder in the usage line.
        choices: the accepted values.
        parse: converts the command-line text when the field's type is not a plain
            ``int`` / ``float`` / ``str`` / ``Path`` / ``bool``.
        shared: use the command line's shared option of this name instead of generating one.
    """
    if group not in OPTION_GROUPS:
        raise ValueError(f"unknown option group {group!r}; choose one of {OPTION_GROUPS}")
    meta: dict[str, Any] = {"help": help, "group": group}
    for key, value in (("metavar", metavar), ("parse", parse), ("shared", shared)):
        if value is not None:
            meta[key] = value
    if choices is not None:
        meta["choices"] = tuple(choices)
    return meta


def flag_name(name: str) -> str:
    """The ``convnets train`` flag of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def _flag_words(text: str) -> str:
    # Field names mentioned inside a message, in command-line spelling (one pass: no re-replacing).
    return re.sub(r"\b(pretrained_from_file|pretrained|resume|labels|multilabel)\b", lambda m: flag_name(m.group(1)),
                  text)


#: The counts of :class:`TrainConfig`: at least 1, or at least 0. ``convnets train`` checks them while it
#: parses its command line (a usage error before PyTorch is imported), the config again when built.
POSITIVE_INT_FIELDS = ("epochs", "batch_size", "grad_accum", "image_size", "print_freq", "max_nonfinite_steps")
NON_NEGATIVE_INT_FIELDS = ("workers", "seed")


@dataclass
class TrainConfig:
    """Everything a run depends on; defaults are NVIDIA's recipe (see :mod:`convnets.train.recipe`).

    Attributes:
        data: directory with ``train/<class>/*`` and ``val/<class>/*`` (ImageFolder layout), or the
            images of ``labels``; not needed with ``data_backend="synthetic"``.
        labels: with ``multilabel``: a CSV of ``path`` (relative to ``data``), ``labels`` (``;``-separated)
            and optionally ``split`` (``train`` / ``val``; default: the first folder of ``path``); see
            :mod:`convnets.data.multilabel`.
        multilabel: multi-label fine-tuning: a sigmoid per class and ``BCEWithLogitsLoss`` (label
            smoothing moves each target towards ``label_smoothing / classes``, as timm's
            ``BinaryCrossEntropy``; MixUp mixes the multi-hot targets), the best epoch by validation
            mAP, and per-class thresholds maximising each class's F1 on the validation split, stored in
            the checkpoints.
        output: directory for ``checkpoint.pth.tar``, ``model_best.pth.tar``,
            ``model_best.safetensors`` and ``metrics.jsonl`` (not needed with ``evaluate``).
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
        memory_format: ``"channels_last"`` or ``"contiguous"`` (``"nhwc"`` / ``"nchw"`` are
            accepted for them); ``None``: channels_last under AMP, else contiguous.
        data_backend: ``"pytorch"``, ``"dali-cpu"``, ``"dali-gpu"`` or ``"synthetic"``.
        workers: data-loader processes (pytorch) or decoding threads (DALI) per training process; ``None``:
            as many as ``convnets predict`` starts (:func:`convnets.runtime.default_workers`), the machine's
            share of each process under ``torchrun``.
        device: ``"auto"`` or ``None`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        seed: seed of initialisation, data order and augmentation.
        resume: continue from this training checkpoint.
        evaluate: only validate the weights of ``resume`` / ``pretrained*``.
        progress: show a progress bar per epoch (rank 0, stderr).
        tensorboard: also write the per-epoch metrics as TensorBoard events in
            ``output/tensorboard/`` (rank 0; when the ``tensorboard`` package is installed).
        print_freq: every this many optimizer steps of an epoch, also write the training loss,
            lr and images/s of those steps as TensorBoard events (``output/tensorboard/steps/``,
            at the global optimizer step) and, without a progress bar, as INFO log lines
            (upstream's ``--print-freq``, default 10).
        max_nonfinite_steps: stop after this many optimizer steps in a row skipped for a
            non-finite loss or gradient.

    Raises:
        InvalidArgumentError: a value out of range or a missing ``data`` / ``output`` (one message
            listing every problem; a ``ValueError``).
    """

    data: Path | None = field(default=None, metadata=option(
        "directory with train/<class>/* and val/<class>/*, or the images that --labels lists", DATA, metavar="DIR"))
    labels: Path | None = field(default=None, metadata=option(
        "with --multilabel: a CSV with the columns path (relative to --data), labels (separated by ';') and "
        "optionally split (train / val; default: the first folder of path)", DATA, metavar="FILE.csv"))
    multilabel: bool = field(default=False, metadata=option(
        "multi-label fine-tuning on --labels: a sigmoid per class and BCEWithLogitsLoss, the best epoch by "
        "validation mAP, per-class thresholds (best F1 on the validation split) stored in the checkpoints; "
        "--label-smoothing S moves the targets towards S / classes", DATA))
    output: Path | None = field(default=None, metadata=option(
        "directory (created) that gets checkpoint.pth.tar, model_best.pth.tar, model_best.safetensors, "
        "metrics.jsonl, tensorboard/ and curves.png", DATA, shared="output"))
    arch: str = field(default="resnet50", metadata=option(
        f"architecture: {', '.join(list_models())}, or upstream's spelling such as se-resnext101-32x4d "
        "(default: %(default)s; --arch: upstream's name of this option)", MODEL, shared="model"))
    arch_kwargs: dict[str, Any] = field(default_factory=dict, metadata=option(
        'architecture overrides, e.g. \'{"layers": [1,1,1,1], "widths": [32,64,128,256]}\'', MODEL,
        metavar="JSON", shared="arch_kwargs"))
    pretrained: bool = field(default=False, metadata=option(
        "start from NVIDIA's ImageNet weights, the head replaced for the data's classes", MODEL, shared="pretrained"))
    pretrained_from_file: Path | None = field(default=None, metadata=option(
        "start from the weights in this checkpoint, of --model's architecture (--pretrained-from-file: "
        "upstream's name of this option)", MODEL, shared="weights"))
    epochs: int = field(default=90, metadata=option("default: %(default)s", RECIPE))
    batch_size: int = field(default=128, metadata=option("per process (default: %(default)s)", RECIPE))
    grad_accum: int = field(default=1, metadata=option(
        "micro-batches per optimizer step (default: %(default)s)", RECIPE, metavar="N"))
    lr: float | None = field(default=None, metadata=option(
        "peak lr (default: 0.256 x batch-size x processes x grad-accum / 256)", RECIPE))
    warmup_epochs: float | None = field(default=None, metadata=option(
        "linear warmup (default: 0 below an optimizer batch of 512, else min(8, epochs/10))", RECIPE))
    momentum: float = field(default=MOMENTUM, metadata=option("default: %(default)s", RECIPE))
    weight_decay: float = field(default=WEIGHT_DECAY, metadata=option(
        "on conv/linear weights only (default: 1/16384 = %(default)s)", RECIPE))
    label_smoothing: float = field(default=LABEL_SMOOTHING, metadata=option("default: %(default)s", RECIPE))
    mixup: float = field(default=0.0, metadata=option("MixUp alpha, 0 = off (default)", RECIPE, metavar="ALPHA"))
    ema: float | None = field(default=None, metadata=option(
        "keep and evaluate an EMA of the weights, e.g. 0.9999", RECIPE, metavar="DECAY"))
    image_size: int = field(default=DEFAULT_IMAGE_SIZE, metadata=option(
        "training and validation crop size (default: %(default)s)", DATA, shared="image_size"))
    amp: bool | None = field(default=None, metadata=option(
        "upstream's --amp: mixed precision in the device's half type, fp16 autocast with a GradScaler on CUDA, "
        "bf16 autocast on CPUs (default: on where it helps: CUDA, CPUs with native bf16); --no-amp is "
        "--precision fp32", DEVICES, shared="amp"))
    amp_dtype: str | None = field(default=None, metadata=option(
        "fp32, or bf16 / fp16 autocast (fp16 on CUDA, with a GradScaler); default: fp16 on CUDA, bf16 on CPUs "
        "with native bf16, else fp32 (--amp-dtype: the older name of this option)", DEVICES, shared="precision"))
    memory_format: str | None = field(default=None, metadata=option(
        "layout of the model and its batches (default: channels_last under AMP, else contiguous; nhwc / nchw "
        "are accepted for them)", DEVICES, shared="memory_format"))
    data_backend: str = field(default="pytorch", metadata=option(
        "input pipeline (default: %(default)s; dali-* need nvidia-dali-cuda130)", DATA, choices=BACKENDS))
    workers: int | None = field(default=None, metadata=option(
        "loader processes / DALI threads per training process (default: as many as `convnets predict` starts: "
        "min(4, cores - 2) on the CPU, min(16, cores - 1) with a GPU, the cores shared by a machine's processes)",
        DATA))
    device: str | None = field(default=None, metadata=option(
        "auto (default): cuda when available, else cpu; or cpu, cuda, cuda:N (under torchrun each process "
        "takes GPU LOCAL_RANK)", DEVICES, shared="device"))
    seed: int = field(default=0, metadata=option("default: %(default)s", RECIPE))
    resume: Path | None = field(default=None, metadata=option(
        "continue the run of this checkpoint", RUN, metavar="CHECKPOINT"))
    evaluate: bool = field(default=False, metadata=option(
        "only validate the weights of --resume or --pretrained / --pretrained-from-file", RUN))
    progress: bool = field(default=True, metadata=option("no progress bar", RUN))
    tensorboard: bool = field(default=True, metadata=option(
        "write no TensorBoard events (default: DIR/tensorboard/ of --output when the tensorboard package is installed)", RUN))
    print_freq: int = field(default=10, metadata=option(
        "every N optimizer steps, write the training loss, lr and img/s of those steps to TensorBoard "
        "(DIR/tensorboard/steps/ of --output, at the global step) and, with --no-progress -v, to the log (default: "
        "%(default)s)", RUN, metavar="N"))
    max_nonfinite_steps: int = field(default=10, metadata=option(
        "stop after this many optimizer steps in a row skipped for a non-finite loss or gradient "
        "(default: %(default)s)", RUN, metavar="N"))

    def __post_init__(self) -> None:
        for name in ("data", "labels", "output", "pretrained_from_file", "resume"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, Path(value))
        self.arch_kwargs = dict(self.arch_kwargs)
        problems: list[tuple[str, str]] = []  # (field, what is wrong): named per interface below
        for name in POSITIVE_INT_FIELDS:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append((name, f"must be a positive integer, got {getattr(self, name)!r}"))
        for name in NON_NEGATIVE_INT_FIELDS:
            if name == "workers" and self.workers is None:  # the machine's default, chosen where it runs
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                problems.append((name, f"must be a non-negative integer, got {getattr(self, name)!r}"))
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
                problems.append((name, f"is out of range: {value!r}"))
        if self.data_backend not in BACKENDS:
            problems.append(("data_backend", f"must be one of {', '.join(BACKENDS)}, got {self.data_backend!r}"))
        if self.multilabel and self.labels is None:
            problems.append(("multilabel", "needs labels, a CSV of the images and their label sets"))
        if self.labels is not None and not self.multilabel:
            problems.append(("labels", "is the CSV of multi-label training: give multilabel too"))
        if self.multilabel and self.data_backend != "pytorch":
            problems.append(("multilabel", f"reads its images with the pytorch data backend, not {self.data_backend}"))
        if self.data_backend != "synthetic" and self.data is None:
            problems.append(("data", f"(a directory) is required with the {self.data_backend} backend"))
        if self.evaluate:
            if self.resume is None and not self.pretrained and self.pretrained_from_file is None:
                problems.append(("evaluate", "needs weights: resume, pretrained or pretrained_from_file"))
        elif self.output is None:
            problems.append(("output", "(a directory) is required for training"))
        if problems:
            # Each field is a flag of `convnets train` (--field-name), so the command line gets the
            # same message in its own words.
            raise InvalidArgumentError(
                "invalid training configuration: " + "; ".join(f"{name} {what}" for name, what in problems),
                cli="invalid training configuration: " + "; ".join(
                    f"{flag_name(name)} {_flag_words(what)}" for name, what in problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (paths as strings), for checkpoints and logs."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}
