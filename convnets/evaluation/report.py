"""The report of ``convnets evaluate``: metrics computed from the totals of the evaluation loop.

:class:`EvalTotals` holds the sums that :func:`convnets.evaluation.loop.accumulate` returns.
:meth:`EvaluationReport.from_totals` derives from them the headline metrics declared in
:data:`METRICS`, the per-class precision / recall / F1 / support and the most confused class
pairs. :data:`METRICS` is the one place a headline metric is defined: ``report.json``, the
printed table and the attribute (``report.top1``) all come from it, so adding a metric is one
:class:`Metric` line here (and its test).

Conventions (scikit-learn's): rows of the confusion matrix are true classes, columns predicted
ones, in the model's class order; a class never predicted has precision 0, one without images
recall 0 (``zero_division=0``); the macro averages are over the classes that have images. Top-1
and top-5 are percentages (as in ``metrics.jsonl`` and NVIDIA's tables), the per-class figures
fractions. The loss is the plain cross-entropy (no label smoothing), i.e. scikit-learn's
``log_loss`` of the softmax probabilities.

No PyTorch here: a report can be rebuilt and written from saved totals.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from convnets.constants import REPORT_FILES
from convnets.errors import InvalidArgumentError
from convnets.extras import install_hint
from convnets.fileio import preflight, write_output
from convnets.text import printable

__all__ = ["CONFUSION", "METRICS", "REPORT", "ClassMetrics", "ConfusedPair", "Counts", "EvalTotals",
           "EvaluationReport", "Metric", "MetricAttributes", "check_report_destination"]

log = logging.getLogger(__name__)

#: File names in the report directory.
REPORT, CONFUSION = REPORT_FILES
#: Most confused pairs kept in the report.
TOP_PAIRS = 20


@dataclass
class EvalTotals:
    """Sums over an evaluation set (all ranks): what :func:`~convnets.evaluation.loop.accumulate` returns.

    Attributes:
        loss_sum: summed per-image loss.
        top1, top5: images whose class is the first / among the first five predictions.
        images: images evaluated.
        unreadable: image files that could not be read (left out).
        confusion: ``[true, predicted]`` counts, when asked for.
        scores, targets: multi-label batches (multi-hot targets): every image's sigmoid probabilities
            and its multi-hot target, ``[images, classes]`` (all ranks'); top-1 and top-5 are then 0.
    """

    loss_sum: float
    top1: int
    top5: int
    images: int
    unreadable: int
    confusion: npt.NDArray[Any] | None = None
    scores: npt.NDArray[Any] | None = None
    targets: npt.NDArray[Any] | None = None


@dataclass(frozen=True)
class Counts:
    """What a :class:`Metric` is computed from: the totals and the per-class arrays of their confusion matrix.

    Attributes:
        totals: the sums of the evaluation loop (``totals.confusion`` is set).
        images: ``totals.images``.
        confusion: ``[true, predicted]`` counts, ``C x C`` int64.
        support, predicted: images of each class / predicted as each class.
        precision, recall, f1: per class, 0 where undefined (``zero_division=0``).
        present: the classes with images (what macro averages run over).
    """

    totals: EvalTotals
    images: int
    confusion: npt.NDArray[Any]
    support: npt.NDArray[Any]
    predicted: npt.NDArray[Any]
    precision: npt.NDArray[Any]
    recall: npt.NDArray[Any]
    f1: npt.NDArray[Any]
    present: npt.NDArray[Any]

    @classmethod
    def of(cls, totals: EvalTotals) -> Counts:
        """Derive the per-class arrays.

        Args:
            totals: sums with a confusion matrix (``accumulate(..., num_classes=C)``).

        Returns:
            The counts.

        Raises:
            InvalidArgumentError: the totals hold no confusion matrix.
        """
        if totals.confusion is None:
            raise InvalidArgumentError("the totals hold no confusion matrix: accumulate with num_classes")
        cm = totals.confusion.astype(np.int64)
        tp = np.diag(cm).astype(float)
        support, predicted = cm.sum(1), cm.sum(0)
        with np.errstate(divide="ignore", invalid="ignore"):
            precision = np.where(predicted > 0, tp / predicted, 0.0)
            recall = np.where(support > 0, tp / support, 0.0)
            f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        return cls(totals, totals.images, cm, support, predicted, precision, recall, f1, support > 0)


@dataclass(frozen=True)
class Metric:
    """One headline figure of the report.

    Attributes:
        key: its name in ``report.json`` and as an attribute of :class:`EvaluationReport`.
        shown: its text in the table's summary line, a :meth:`str.format` template of the value.
        compute: the value, from the counts.
        sep: what precedes it in the summary line (``" "`` keeps it in the previous one's group).
    """

    key: str
    shown: str
    compute: Callable[[Counts], float]
    sep: str = "   "


#: The headline metrics, in report.json's and the table's order.
METRICS: tuple[Metric, ...] = (
    Metric("top1", "top-1 {:.2f}%", lambda c: 100 * c.totals.top1 / c.images),
    Metric("top5", "top-5 {:.2f}%", lambda c: 100 * c.totals.top5 / c.images),
    Metric("loss", "loss {:.4f}", lambda c: c.totals.loss_sum / c.images),
    Metric("macro_precision", "macro precision {:.3f}", lambda c: float(c.precision[c.present].mean())),
    Metric("macro_recall", "recall {:.3f}", lambda c: float(c.recall[c.present].mean()), sep=" "),
    Metric("macro_f1", "F1 {:.3f}", lambda c: float(c.f1[c.present].mean()), sep=" "),
)


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


class MetricAttributes:
    """Each entry of a report's ``metrics`` dict is also an attribute (``report.top1``, ``report.mAP``)."""

    def __getattr__(self, name: str) -> float:
        # Only reached when ordinary lookup fails. Read __dict__ directly: during copy/unpickling
        # ``metrics`` is not set yet, and ``self.metrics`` would recurse here.
        metrics = self.__dict__.get("metrics", {})
        if name in metrics:
            return float(metrics[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass
class EvaluationReport(MetricAttributes):
    """What :func:`~convnets.evaluation.loop.evaluate_model` measured (conventions: the module docstring).

    Each metric of :data:`METRICS` is also an attribute: ``report.top1``, ``report.macro_f1``, ...

    Attributes:
        images: images evaluated; ``unreadable``: image files left out.
        metrics: the values of :data:`METRICS`, by key, in their order.
        classes: per-class figures, every output of the model in its order.
        confusion: ``[true, predicted]`` counts, ``C x C``.
        confused_pairs: the most frequent off-diagonal cells, most frequent first.
        source: how it was run (data, layout, labels file, model, weights, preset, precision, ...).
    """

    images: int
    unreadable: int
    metrics: dict[str, float]
    classes: list[ClassMetrics]
    confusion: npt.NDArray[Any]
    confused_pairs: list[ConfusedPair]
    source: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_totals(cls, totals: EvalTotals, keys: list[str], names: list[str],
                    source: dict[str, Any] | None = None) -> EvaluationReport:
        """Derive the metrics, the per-class figures and the confused pairs from the loop's sums.

        Args:
            totals: the sums of :func:`~convnets.evaluation.loop.accumulate`, with a confusion matrix.
            keys, names: each class's key (class name or WordNet id) and readable name, in the model's order.
            source: how it was run (kept in ``report.json``).

        Returns:
            The report.

        Raises:
            InvalidArgumentError: the totals hold no confusion matrix.
        """
        c = Counts.of(totals)
        per_class = [ClassMetrics(i, keys[i], names[i], float(c.precision[i]), float(c.recall[i]), float(c.f1[i]),
                                  int(c.support[i]), int(c.predicted[i])) for i in range(len(keys))]
        off = c.confusion.copy()
        np.fill_diagonal(off, 0)
        flat = np.flatnonzero(off)
        # Most frequent first; ties in class order (stable sort of the row-major positions).
        order = flat[np.argsort(-off.ravel()[flat], kind="stable")][:TOP_PAIRS]
        pairs = [ConfusedPair(int(t), int(p), names[t], names[p], int(off[t, p]), float(off[t, p] / c.support[t]))
                 for t, p in (divmod(int(k), off.shape[0]) for k in order)]
        return cls(images=totals.images, unreadable=totals.unreadable,
                   metrics={m.key: m.compute(c) for m in METRICS}, classes=per_class, confusion=c.confusion,
                   confused_pairs=pairs, source=dict(source or {}))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: what ``report.json`` holds."""
        return {
            "images": self.images, "unreadable_images": self.unreadable, **self.metrics, **self.source,
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

    def summary(self) -> str:
        """The metrics on one line: ``top-1 76.13%   top-5 92.86%   loss 0.9618   macro precision ...``."""
        present = sum(1 for c in self.classes if c.support > 0)
        text = "".join((m.sep if i else "") + m.shown.format(self.metrics[m.key]) for i, m in enumerate(METRICS))
        return f"{text} ({present} classes with images)"

    def table(self, max_classes: int = 40) -> str:
        """A readable summary: totals, the classes (the ``max_classes`` lowest F1 when there are
        more), the most confused pairs.

        Args:
            max_classes: most class rows shown.

        Returns:
            The text, without a final newline.
        """
        s = self.source
        lines = [f"{self.images} images ({s.get('layout', '?')} layout of {s.get('data', '?')}), "
                 f"{s.get('model', 'model')} [{s.get('weights', '?')}], {s.get('precision', '?')} on {s.get('device', '?')}"
                 + (f" ({s['engine']})" if s.get("engine") else "")]
        if self.unreadable:
            lines.append(f"{self.unreadable} unreadable images left out")
        lines.append(self.summary())
        present = [c for c in self.classes if c.support > 0]
        shown = present
        if len(present) > max_classes:
            shown = sorted(present, key=lambda c: (c.f1, c.index))[:max_classes]
            lines.append(f"\nthe {max_classes} classes of lowest F1 (all {len(present)} in {REPORT}):")
        else:
            lines.append("")
        names = {c.index: printable(c.name) for c in shown}  # class names from a checkpoint or folders: data
        width = min(max([len("class"), *map(len, names.values())]), 40)
        lines.append(f"{'class':<{width}}  precision  recall     f1  support")
        for c in shown:
            lines.append(f"{names[c.index][:width]:<{width}}  {c.precision:9.3f}  {c.recall:6.3f}  {c.f1:5.3f}  "
                         f"{c.support:7d}")
        if self.confused_pairs:
            lines.append("\nmost confused (true -> predicted: images, share of the true class):")
            for p in self.confused_pairs[:10]:
                lines.append(f"  {printable(p.true_name)} -> {printable(p.predicted_name)}: {p.count} "
                             f"({100 * p.fraction:.1f}%)")
        return "\n".join(lines)

    def write(self, directory: str | os.PathLike[str], *, figure: bool = True, force: bool = False) -> list[Path]:
        """Write ``report.json`` (atomically) and, with matplotlib installed, ``confusion.png``.

        Args:
            directory: the report directory (created if needed).
            figure: also draw ``confusion.png``; without matplotlib one warning line, no failure.
            force: replace the files of an earlier report (see :func:`check_report_destination`).

        Returns:
            The files written.

        Raises:
            InvalidArgumentError: a file exists (without ``force``) or is a symbolic link.
        """
        directory = Path(directory)
        check_report_destination(directory, force=force)
        directory.mkdir(parents=True, exist_ok=True)
        written = [write_output(directory / REPORT, lambda f: f.write(self.to_json().encode()), force=force)]
        if figure:
            from convnets.evaluation.confusion import plot_confusion

            try:
                written.append(plot_confusion(self.confusion, [c.name for c in self.classes], directory / CONFUSION,
                                              summary=f"top-1 {self.metrics['top1']:.2f}% on {self.images} images",
                                              force=force))
            except ImportError:  # MissingDependencyError too
                log.warning("%s not drawn: matplotlib is not installed (%s)", CONFUSION, install_hint("plots"))
        return written


def check_report_destination(directory: str | os.PathLike[str], *, force: bool = False) -> None:
    """Before an evaluation: its report can go to ``directory``, where ``report.json`` and ``confusion.png``
    do not exist unless ``force`` (:func:`convnets.fileio.preflight`).

    Raises:
        InvalidArgumentError: one exists (without ``force``), naming it and ``force`` / ``--force``.
    """
    for name in REPORT_FILES:
        preflight(Path(directory) / name, force=force)
