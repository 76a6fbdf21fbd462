"""Evaluation: the one loop that validates a model, and the report of ``convnets evaluate``.

:func:`accumulate` runs a model over evaluation batches and sums loss, top-1 / top-5 hits and,
when asked, the confusion matrix (summed over DDP ranks). The training loop's per-epoch
validation and ``train --evaluate`` (:func:`convnets.train.loop.evaluate`) and
:func:`evaluate_model` (``convnets evaluate``) all use it.

:func:`evaluate_model` reads a data set in any layout of :mod:`convnets.evaluation.data` (class
folders, ImageNet's flat validation images with Kaggle's or the devkit's labels), runs the model
with its own evaluation preset (:func:`~convnets.preprocessing.presets.preset_for_model`: what
``train --evaluate`` and ``predict`` use) and returns an :class:`EvaluationReport`: top-1, top-5,
cross-entropy loss, per-class precision / recall / F1 / support, the confusion matrix and the most
confused class pairs. :meth:`EvaluationReport.write` saves ``report.json`` (atomically) and
``confusion.png``.

Conventions (scikit-learn's): rows of the confusion matrix are true classes, columns predicted
ones, in the model's class order; a class never predicted has precision 0, one without images
recall 0 (``zero_division=0``); the macro averages are over the classes that have images. Top-1
and top-5 are percentages (as in ``metrics.jsonl`` and NVIDIA's tables), the per-class figures
fractions. The loss is the plain cross-entropy (no label smoothing), i.e. scikit-learn's
``log_loss`` of the softmax probabilities.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from convnets import dist
from convnets.dist import DistContext
from convnets.errors import DataError, InvalidArgumentError
from convnets.fileio import atomic_write
from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes, get_imgnet_synsets
from convnets.preprocessing.presets import DEFAULT_PRESET, EvalPreset, preset_for_model
from convnets.data.batches import Batch
from convnets.data.folders import eval_loader, to_device
from convnets.evaluation.data import EvalSamples, find_eval_samples
from convnets.runtime import Precision

__all__ = ["CONFUSION", "REPORT", "ClassMetrics", "ConfusedPair", "EvalTotals", "EvaluationReport", "accumulate",
           "evaluate_model"]

log = logging.getLogger(__name__)

#: File names in the report directory.
REPORT = "report.json"
CONFUSION = "confusion.png"
#: Most confused pairs kept in the report.
TOP_PAIRS = 20


@dataclass
class EvalTotals:
    """Sums over an evaluation set (all ranks): what :func:`accumulate` returns.

    Attributes:
        loss_sum: summed per-image loss.
        top1, top5: images whose class is the first / among the first five predictions.
        images: images evaluated.
        unreadable: image files that could not be read (left out).
        confusion: ``[true, predicted]`` counts, when asked for.
    """

    loss_sum: float
    top1: int
    top5: int
    images: int
    unreadable: int
    confusion: np.ndarray | None = None


@torch.inference_mode()
def accumulate(model: nn.Module, batches: Iterable[Batch], precision: Precision, ctx: DistContext,
               criterion: nn.Module | None = None, *, num_classes: int | None = None,
               preset: EvalPreset = DEFAULT_PRESET, progress: Any = None) -> EvalTotals:
    """Run ``model`` over ``batches`` and sum what evaluation reports, over all processes.

    Args:
        model: the network (put in eval mode here).
        batches: ``(images, targets, unreadable)`` batches of this process's share.
        precision: device, autocast and memory format.
        ctx: this process's place in the job (sums are all-reduced).
        criterion: the loss (e.g. label-smoothed, as in training); ``None``: cross-entropy in float64.
        num_classes: also count the confusion matrix of this many classes.
        preset: the mean and std that normalise uint8 batches.
        progress: a ``tqdm`` bar to advance by the images of each batch.

    Raises:
        DataError: no image could be read.
    """
    model.eval()
    device = precision.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits
    confusion = None if num_classes is None else torch.zeros(num_classes * num_classes, dtype=torch.int64,
                                                             device=device)
    images_seen = unreadable = 0
    for images, targets, bad in batches:
        unreadable += bad
        if len(targets) == 0:
            continue
        x = to_device(images, device, precision.memory_format, preset)
        y = targets.to(device, non_blocking=True)
        with precision.autocast():
            out = model(x)
        if criterion is None:
            loss = F.cross_entropy(out.double(), y, reduction="sum")
        else:
            loss = criterion(out.float(), y).double() * len(y)
        top = out.topk(min(5, out.shape[1]), dim=1).indices
        hits = top == y[:, None]
        sums += torch.stack([loss, hits[:, 0].sum(), hits.any(1).sum()])
        if confusion is not None:
            confusion += torch.bincount(y * num_classes + top[:, 0], minlength=num_classes * num_classes)
        images_seen += len(y)
        if progress is not None:
            progress.update(len(y))
    loss_sum, top1, top5 = sums.tolist()
    loss_sum, top1, top5, n, unreadable = dist.all_reduce_sum([loss_sum, top1, top5, images_seen, unreadable], ctx)
    if n == 0:
        raise DataError("no evaluation image could be read")
    matrix = None
    if confusion is not None:
        if ctx.distributed:
            torch.distributed.all_reduce(confusion)
        matrix = confusion.view(num_classes, num_classes).cpu().numpy()
    return EvalTotals(loss_sum, int(top1), int(top5), int(n), int(unreadable), matrix)


@dataclass(frozen=True)
class ClassMetrics:
    """One class's figures (fractions 0..1; ``support``: its images, ``predicted``: images predicted as it)."""

    index: int
    key: str
    name: str
    precision: float
    recall: float
    f1: float
    support: int
    predicted: int


@dataclass(frozen=True)
class ConfusedPair:
    """Images of class ``true`` predicted as class ``predicted``; ``fraction`` of ``true``'s images."""

    true: int
    predicted: int
    true_name: str
    predicted_name: str
    count: int
    fraction: float


@dataclass
class EvaluationReport:
    """What :func:`evaluate_model` measured (see the module docstring for the conventions).

    Attributes:
        images: images evaluated; ``unreadable``: image files left out.
        top1, top5: accuracy in percent.
        loss: mean cross-entropy.
        macro_precision, macro_recall, macro_f1: means over the classes with images.
        classes: per-class figures, every output of the model in its order.
        confusion: ``[true, predicted]`` counts, ``C x C``.
        confused_pairs: the most frequent off-diagonal cells, most frequent first.
        source: how it was run (data, layout, labels file, model, weights, preset, precision, ...).
    """

    images: int
    unreadable: int
    top1: float
    top5: float
    loss: float
    macro_precision: float
    macro_recall: float
    macro_f1: float
    classes: list[ClassMetrics]
    confusion: np.ndarray
    confused_pairs: list[ConfusedPair]
    source: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_totals(cls, totals: EvalTotals, keys: list[str], names: list[str],
                    source: dict[str, Any] | None = None) -> EvaluationReport:
        """Derive the per-class figures and the confused pairs from the sums of :func:`accumulate`."""
        if totals.confusion is None:
            raise InvalidArgumentError("the totals hold no confusion matrix: accumulate with num_classes")
        cm = totals.confusion.astype(np.int64)
        tp = np.diag(cm).astype(float)
        support, predicted = cm.sum(1), cm.sum(0)
        with np.errstate(divide="ignore", invalid="ignore"):
            precision = np.where(predicted > 0, tp / predicted, 0.0)
            recall = np.where(support > 0, tp / support, 0.0)
            f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        per_class = [ClassMetrics(i, keys[i], names[i], float(precision[i]), float(recall[i]), float(f1[i]),
                                  int(support[i]), int(predicted[i])) for i in range(len(keys))]
        present = support > 0
        off = cm.copy()
        np.fill_diagonal(off, 0)
        flat = np.flatnonzero(off)
        # Most frequent first; ties in class order (stable sort of the row-major positions).
        order = flat[np.argsort(-off.ravel()[flat], kind="stable")][:TOP_PAIRS]
        pairs = [ConfusedPair(int(t), int(p), names[t], names[p], int(off[t, p]), float(off[t, p] / support[t]))
                 for t, p in (divmod(int(k), cm.shape[0]) for k in order)]
        n = totals.images
        return cls(images=n, unreadable=totals.unreadable, top1=100 * totals.top1 / n, top5=100 * totals.top5 / n,
                   loss=totals.loss_sum / n, macro_precision=float(precision[present].mean()),
                   macro_recall=float(recall[present].mean()), macro_f1=float(f1[present].mean()),
                   classes=per_class, confusion=cm, confused_pairs=pairs, source=dict(source or {}))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: what ``report.json`` holds."""
        return {
            "images": self.images, "unreadable_images": self.unreadable, "top1": self.top1, "top5": self.top5,
            "loss": self.loss, "macro_precision": self.macro_precision, "macro_recall": self.macro_recall,
            "macro_f1": self.macro_f1, **self.source,
            "classes": [asdict(c) for c in self.classes],
            "confused_pairs": [asdict(p) for p in self.confused_pairs],
            "confusion_matrix": self.confusion.tolist(),
        }

    def to_json(self) -> str:
        """``report.json``'s text: indented, with one line per confusion-matrix row (1000 short lines
        for ImageNet rather than a million)."""
        data = self.to_dict()
        rows = data.pop("confusion_matrix")
        text = json.dumps(data, indent=1)
        matrix = ",\n  ".join(json.dumps(row, separators=(",", ":")) for row in rows)
        return f'{text[:-2]},\n "confusion_matrix": [\n  {matrix}\n ]\n}}\n'

    def table(self, max_classes: int = 40) -> str:
        """A readable summary: totals, the classes (the ``max_classes`` lowest F1 when there are
        more), the most confused pairs."""
        s = self.source
        lines = [f"{self.images} images ({s.get('layout', '?')} layout of {s.get('data', '?')}), "
                 f"{s.get('model', 'model')} [{s.get('weights', '?')}], {s.get('precision', '?')} on {s.get('device', '?')}"]
        if self.unreadable:
            lines.append(f"{self.unreadable} unreadable images left out")
        present = [c for c in self.classes if c.support > 0]
        lines.append(f"top-1 {self.top1:.2f}%   top-5 {self.top5:.2f}%   loss {self.loss:.4f}   macro precision "
                     f"{self.macro_precision:.3f} recall {self.macro_recall:.3f} F1 {self.macro_f1:.3f} "
                     f"({len(present)} classes with images)")
        shown = present
        if len(present) > max_classes:
            shown = sorted(present, key=lambda c: (c.f1, c.index))[:max_classes]
            lines.append(f"\nthe {max_classes} classes of lowest F1 (all {len(present)} in {REPORT}):")
        else:
            lines.append("")
        width = max([len("class"), *(len(c.name) for c in shown)])
        width = min(width, 40)
        lines.append(f"{'class':<{width}}  precision  recall     f1  support")
        for c in shown:
            lines.append(f"{c.name[:width]:<{width}}  {c.precision:9.3f}  {c.recall:6.3f}  {c.f1:5.3f}  {c.support:7d}")
        if self.confused_pairs:
            lines.append("\nmost confused (true -> predicted: images, share of the true class):")
            for p in self.confused_pairs[:10]:
                lines.append(f"  {p.true_name} -> {p.predicted_name}: {p.count} ({100 * p.fraction:.1f}%)")
        return "\n".join(lines)

    def write(self, directory: str | os.PathLike[str], *, figure: bool = True) -> list[Path]:
        """Write ``report.json`` (atomically) and, with matplotlib installed, ``confusion.png``.

        Args:
            directory: the report directory (created if needed).
            figure: also draw ``confusion.png``; without matplotlib one warning line, no failure.

        Returns:
            The files written.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / REPORT, lambda f: f.write(self.to_json().encode()))
        written = [directory / REPORT]
        if figure:
            from convnets.evaluation.confusion import plot_confusion

            try:
                written.append(plot_confusion(self.confusion, [c.name for c in self.classes], directory / CONFUSION,
                                              summary=f"top-1 {self.top1:.2f}% on {self.images} images"))
            except ImportError:  # MissingDependencyError too
                log.warning("%s not drawn: matplotlib is not installed (pip install 'convnets-hub[plots]')", CONFUSION)
        return written


def class_keys_and_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """The model's class keys (its class names, or ImageNet's WordNet ids) and readable names."""
    num = int(getattr(model, "num_classes", 0))
    class_names = getattr(model, "class_names", None)
    if class_names is not None:
        keys = [str(c) for c in class_names]
        if num == NUM_CLASSES and keys == [str(s) for s in get_imgnet_synsets()]:
            return keys, _short_imagenet_names()
        return keys, keys
    if num == NUM_CLASSES:
        return [str(s) for s in get_imgnet_synsets()], _short_imagenet_names()
    return [f"class {i}" for i in range(num)], [f"class {i}" for i in range(num)]


def _short_imagenet_names() -> list[str]:
    return [str(n).split(",")[0] for n in get_imgnet_classes()]


def _resolve_model(model: nn.Module | str | os.PathLike[str]) -> tuple[nn.Module, str, str]:
    from convnets.models.specs import MODEL_SPECS, registered_name
    from convnets.registry import get_model, load_model

    if isinstance(model, nn.Module):
        spec = getattr(model, "spec", None)
        return model, (registered_name(spec) if spec is not None else None) or type(model).__name__, "given"
    text = str(model)
    if not Path(text).exists() and text.replace("-", "_") in MODEL_SPECS:
        return get_model(text, pretrained=True), text, "pretrained"
    loaded = load_model(text)
    return loaded, registered_name(loaded.spec) or "custom ResNet", text


def evaluate_model(model: nn.Module | str | os.PathLike[str], data: str | os.PathLike[str], *,
                   labels: str | os.PathLike[str] | None = None, output: str | os.PathLike[str] | None = None,
                   batch_size: int = 64, workers: int = 4, device: str | torch.device | None = None,
                   precision: str = "fp32", memory_format: str | None = None, progress: bool = False) -> EvaluationReport:
    """Evaluate a model on a labelled image set and (with ``output``) write its report.

    Example::

        report = evaluate_model("se_resnext101_32x4d", "imagenet/val", output="report/")
        print(report.top1, report.confused_pairs[0])

    Args:
        model: a model (moved to ``device``, in eval mode), a checkpoint path (any layout
            :func:`convnets.load_model` reads), or a registered name (its pretrained weights).
        data: the data set, in any layout of :mod:`convnets.evaluation.data`.
        labels: the labels file of a flat ImageNet layout (default: searched for).
        output: the report directory: ``report.json`` and ``confusion.png``; ``None``: none written.
        batch_size: images per forward pass.
        workers: data-loader processes.
        device: ``"auto"`` / ``None`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast).
        memory_format: ``"channels_last"`` / ``"contiguous"``; ``None``: channels_last under autocast.
        progress: show a progress bar on stderr.

    Returns:
        The report.

    Raises:
        DataError: no layout matches ``data``, its classes are not the model's, or no image is readable.
        InvalidArgumentError, UnsupportedPrecisionError: a bad setting.
        CheckpointError, WeightsUnavailableError: from loading the model.
    """
    from convnets.runtime import PRECISIONS, resolve_device, resolve_precision

    for name, value in (("batch_size", batch_size), ("workers", workers)):
        if not isinstance(value, int) or value < (1 if name == "batch_size" else 0):
            raise InvalidArgumentError(f"{name} must be a {'positive' if name == 'batch_size' else 'non-negative'} "
                                       f"integer, got {value!r}")
    if precision not in PRECISIONS:
        raise InvalidArgumentError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    start = time.perf_counter()
    net, model_name, weights = _resolve_model(model)
    dev = resolve_device(device, option="device")
    amp = precision != "fp32"
    run = resolve_precision(dev, amp=amp, amp_dtype=precision if amp else None, memory_format=memory_format,
                            option="precision")
    keys, names = class_keys_and_names(net)
    found: EvalSamples = find_eval_samples(data, class_names=getattr(net, "class_names", None),
                                           num_classes=len(keys), labels=labels)
    preset = preset_for_model(net)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=dev)
    net.to(dev, memory_format=run.memory_format)
    batches = eval_loader(found.samples, preset, batch_size=batch_size, workers=workers, ctx=ctx)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(found.samples), unit="img", file=sys.stderr, dynamic_ncols=True)
    try:
        totals = accumulate(net, batches, run, ctx, num_classes=len(keys), preset=preset, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    source = {"data": str(data), "layout": found.layout, "images_dir": str(found.images),
              "labels_file": None if found.labels_file is None else str(found.labels_file),
              "unlabelled_images": found.skipped, "model": model_name, "weights": weights,
              "preset": asdict(preset), "precision": precision, "device": str(dev),
              "seconds": round(time.perf_counter() - start, 3)}
    report = EvaluationReport.from_totals(totals, keys, names, source)
    if output is not None:
        report.write(output)
    return report
