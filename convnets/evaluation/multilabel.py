"""Multi-label figures: average precision, per-class decision thresholds, and the multi-label report.

A multi-label model (``convnets train --multilabel``) scores every class independently (a sigmoid
per output); an image has every label whose probability reaches that class's threshold. This module
holds, without PyTorch:

* :func:`average_precision`: per-class AP, exactly scikit-learn's ``average_precision_score``
  (step-wise precision-recall area over the distinct scores; a class without positives has AP 0, and
  the macro average runs over every class, as scikit-learn's does);
* :func:`choose_thresholds`: per class, the threshold that maximises its F1 on a validation set
  (what training stores in the checkpoint);
* :class:`MultiLabelReport`: what ``convnets evaluate`` reports on a multi-label model: ``mAP``
  (macro AP), ``micro_AP``, per-class AP, and precision / recall / F1 at the model's thresholds,
  macro and micro (scikit-learn's ``precision_score`` / ``recall_score`` / ``f1_score`` with
  ``zero_division=0``), its table, ``report.json`` and the per-class chart ``ap.png``.

Scores are probabilities in ``[0, 1]``; an image has label ``c`` when ``score[c] >= threshold[c]``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from convnets.errors import InvalidArgumentError
from convnets.extras import install_hint
from convnets.fileio import preflight, write_output
from convnets.evaluation.report import MetricAttributes
from convnets.text import printable

__all__ = ["AP_CHART", "DEFAULT_THRESHOLD", "MULTILABEL_FILES", "MultiLabelClass", "MultiLabelReport",
           "average_precision", "choose_thresholds", "predicted_labels"]

log = logging.getLogger(__name__)

#: The threshold of a class that the validation set gives no positive example of.
DEFAULT_THRESHOLD = 0.5
#: The per-class chart of a multi-label report.
AP_CHART = "ap.png"
#: The files of a multi-label report directory.
MULTILABEL_FILES = ("report.json", AP_CHART)


def _check(scores: npt.ArrayLike, targets: npt.ArrayLike) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    s = np.asarray(scores, dtype=np.float64)
    t = np.asarray(targets)
    if s.ndim != 2 or s.shape != t.shape:
        raise InvalidArgumentError(f"scores and targets must be [images, classes] arrays of one shape, got "
                                   f"{list(s.shape)} and {list(t.shape)}")
    return s, t > 0.5


def _ap_1d(score: npt.NDArray[np.float64], positive: npt.NDArray[np.bool_]) -> float:
    """scikit-learn's average precision of one binary problem (0 when there is no positive)."""
    total = int(positive.sum())
    if total == 0 or len(score) == 0:
        return 0.0
    order = np.argsort(-score, kind="mergesort")
    s, p = score[order], positive[order]
    # The last position of each run of equal scores: one point of the precision-recall curve each.
    ends = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
    tps = np.cumsum(p)[ends]
    precision = tps / (ends + 1)
    recall = tps / total
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def average_precision(scores: npt.ArrayLike, targets: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Per-class average precision of ``scores`` ``[N, C]`` against multi-hot ``targets`` ``[N, C]``.

    Args:
        scores: probabilities (any monotone score works: AP depends only on the order).
        targets: 1 where the image has the class, else 0.

    Returns:
        ``[C]`` APs, scikit-learn's ``average_precision_score(targets, scores, average=None)``.
    """
    s, t = _check(scores, targets)
    return np.array([_ap_1d(s[:, c], t[:, c]) for c in range(s.shape[1])], dtype=np.float64)


def choose_thresholds(scores: npt.ArrayLike, targets: npt.ArrayLike) -> list[float]:
    """Per class, the decision threshold that maximises its F1 on ``(scores, targets)`` (a validation set).

    Every cut between two distinct scores is tried; of equally good cuts the highest (most precise)
    wins. The threshold lies halfway between the lowest accepted score and the highest rejected one
    (half the lowest score when all are accepted), so that ``score >= threshold`` reproduces the cut
    and nearby scores of new images fall on the side of their neighbours. A class without positives
    keeps :data:`DEFAULT_THRESHOLD`.

    Returns:
        ``C`` thresholds in ``(0, 1]``.
    """
    s, t = _check(scores, targets)
    thresholds = []
    for c in range(s.shape[1]):
        total = int(t[:, c].sum())
        if total == 0:
            thresholds.append(DEFAULT_THRESHOLD)
            continue
        order = np.argsort(-s[:, c], kind="mergesort")
        score, positive = s[order, c], t[order, c]
        ends = np.r_[np.flatnonzero(np.diff(score)), len(score) - 1]  # accept positions 0..end
        tps = np.cumsum(positive)[ends]
        f1 = 2 * tps / (ends + 1 + total)
        k = int(ends[int(np.argmax(f1))])  # argmax: the first (highest) of equal cuts
        low = score[k]
        below = score[k + 1] if k + 1 < len(score) else 0.0
        thresholds.append(float((low + below) / 2) if low > below else float(low))
    return thresholds


def predicted_labels(scores: npt.ArrayLike, thresholds: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """``scores >= thresholds``: the multi-hot predictions at per-class ``thresholds``."""
    return np.asarray(scores, dtype=np.float64) >= np.asarray(thresholds, dtype=np.float64)[None, :]


def _prf(tp: npt.NDArray[Any], fp: npt.NDArray[Any], fn: npt.NDArray[Any]
         ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Precision, recall and F1 from counts, 0 where undefined (scikit-learn's ``zero_division=0``)."""
    tp, fp, fn = (np.asarray(a, dtype=np.float64) for a in (tp, fp, fn))
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(tp + fp > 0, tp / (tp + fp), 0.0)
        recall = np.where(tp + fn > 0, tp / (tp + fn), 0.0)
        f1 = np.where(2 * tp + fp + fn > 0, 2 * tp / (2 * tp + fp + fn), 0.0)
    return precision, recall, f1


@dataclass(frozen=True)
class MultiLabelClass:
    """One class's figures (fractions 0..1): its AP, threshold, precision / recall / F1 at that threshold,
    ``support`` (images that have it) and ``predicted`` (images given it)."""

    index: int
    name: str
    ap: float
    threshold: float
    precision: float
    recall: float
    f1: float
    support: int
    predicted: int


#: The headline figures, in report.json's and the table's order: (key, text in the summary line).
HEADLINE = (("mAP", "mAP {:.4f}"), ("micro_AP", "micro-AP {:.4f}"), ("macro_precision", "macro precision {:.3f}"),
            ("macro_recall", "recall {:.3f}"), ("macro_f1", "F1 {:.3f}"), ("micro_precision", "micro precision {:.3f}"),
            ("micro_recall", "recall {:.3f}"), ("micro_f1", "F1 {:.3f}"), ("loss", "loss {:.4f}"))


@dataclass
class MultiLabelReport(MetricAttributes):
    """What ``convnets evaluate`` measured on a multi-label model (see the module docstring).

    Each headline figure is also an attribute: ``report.mAP``, ``report.micro_f1``, ...

    Attributes:
        images: images evaluated; ``unreadable``: image files left out.
        metrics: the headline figures (:data:`HEADLINE`), by key.
        classes: per-class figures, every output of the model in its order.
        source: how it was run (data, labels file, model, weights, precision, ...).
    """

    images: int
    unreadable: int
    metrics: dict[str, float]
    classes: list[MultiLabelClass]
    source: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_scores(cls, scores: npt.ArrayLike, targets: npt.ArrayLike, thresholds: npt.ArrayLike,
                    names: list[str], *, loss: float | None = None, unreadable: int = 0,
                    source: dict[str, Any] | None = None) -> MultiLabelReport:
        """The report of probabilities ``scores`` ``[N, C]`` against multi-hot ``targets``.

        Args:
            scores, targets: per image and class.
            thresholds: the model's per-class thresholds.
            names: the class names, in the model's order.
            loss: the mean binary cross-entropy, if measured.
            unreadable: image files left out.
            source: how it was run (kept in ``report.json``).
        """
        s, t = _check(scores, targets)
        th = np.asarray(thresholds, dtype=np.float64)
        if th.shape != (s.shape[1],) or len(names) != s.shape[1]:
            raise InvalidArgumentError(f"{s.shape[1]} classes, but {th.size} thresholds and {len(names)} names")
        pred = predicted_labels(s, th)
        tp, fp, fn = (pred & t).sum(0), (pred & ~t).sum(0), (~pred & t).sum(0)
        precision, recall, f1 = _prf(tp, fp, fn)
        micro = _prf(tp.sum(), fp.sum(), fn.sum())
        aps = average_precision(s, t)
        metrics = {"mAP": float(aps.mean()), "micro_AP": _ap_1d(s.ravel(), t.ravel()),
                   "macro_precision": float(precision.mean()), "macro_recall": float(recall.mean()),
                   "macro_f1": float(f1.mean()), "micro_precision": float(micro[0]), "micro_recall": float(micro[1]),
                   "micro_f1": float(micro[2])}
        if loss is not None:
            metrics["loss"] = float(loss)
        classes = [MultiLabelClass(i, names[i], float(aps[i]), float(th[i]), float(precision[i]), float(recall[i]),
                                   float(f1[i]), int(t[:, i].sum()), int(pred[:, i].sum())) for i in range(len(names))]
        return cls(images=s.shape[0], unreadable=unreadable, metrics=metrics, classes=classes,
                   source=dict(source or {}))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types: what ``report.json`` holds (``multilabel: true``)."""
        return {"multilabel": True, "images": self.images, "unreadable_images": self.unreadable, **self.metrics,
                **self.source, "classes": [asdict(c) for c in self.classes]}

    def to_json(self) -> str:
        """``report.json``'s text."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def summary(self) -> str:
        """The headline figures on one line."""
        parts = [text.format(self.metrics[key]) for key, text in HEADLINE if key in self.metrics]
        return "   ".join(parts)

    def table(self, max_classes: int = 40) -> str:
        """A readable summary: totals, the headline figures, the classes (the ``max_classes`` of lowest AP
        when there are more)."""
        s = self.source
        rows = f"the {s['split']} rows of" if s.get("split") else "the rows of"
        lines = [f"{self.images} images (multi-label: {rows} {s.get('labels_file', '?')}), {s.get('model', 'model')} "
                 f"[{s.get('weights', '?')}], {s.get('precision', '?')} on {s.get('device', '?')}"
                 + (f" ({s['engine']})" if s.get("engine") else "")]
        if self.unreadable:
            lines.append(f"{self.unreadable} unreadable images left out")
        lines.append(self.summary())
        shown = self.classes
        if len(shown) > max_classes:
            shown = sorted(shown, key=lambda c: (c.ap, c.index))[:max_classes]
            lines.append(f"\nthe {max_classes} classes of lowest AP (all {len(self.classes)} in report.json):")
        else:
            lines.append("")
        names = {c.index: printable(c.name) for c in shown}
        width = min(max([len("class"), *map(len, names.values())]), 40)
        lines.append(f"{'class':<{width}}      AP  threshold  precision  recall     f1  support  predicted")
        for c in shown:
            lines.append(f"{names[c.index][:width]:<{width}}  {c.ap:6.3f}  {c.threshold:9.3f}  {c.precision:9.3f}  "
                         f"{c.recall:6.3f}  {c.f1:5.3f}  {c.support:7d}  {c.predicted:9d}")
        return "\n".join(lines)

    def write(self, directory: str | os.PathLike[str], *, figure: bool = True, force: bool = False) -> list[Path]:
        """Write ``report.json`` (atomically) and, with matplotlib installed, the per-class chart ``ap.png``.

        Raises:
            InvalidArgumentError: a file exists (without ``force``) or is a symbolic link.
        """
        directory = Path(directory)
        for name in MULTILABEL_FILES:
            preflight(directory / name, force=force)
        directory.mkdir(parents=True, exist_ok=True)
        written = [write_output(directory / MULTILABEL_FILES[0], lambda f: f.write(self.to_json().encode()), force=force)]
        if figure:
            try:
                written.append(plot_class_ap(self, directory / AP_CHART, force=force))
            except ImportError:  # MissingDependencyError too
                log.warning("%s not drawn: matplotlib is not installed (%s)", AP_CHART, install_hint("plots"))
        return written


def plot_class_ap(report: MultiLabelReport, path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """A horizontal bar chart of each class's AP and F1 at its threshold (the 60 of lowest AP when there
    are more), on a ``Figure`` of its own with the Agg canvas, as ``confusion.png`` is drawn.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        InvalidArgumentError: ``path`` exists (without ``force``).
    """
    from convnets.evaluation.confusion import agg_figure

    shown = sorted(report.classes, key=lambda c: (c.ap, c.index))[:60][::-1]
    fig = agg_figure(Path(path).name, figsize=(7, 1.4 + 0.3 * len(shown)), dpi=100)
    ax = fig.subplots()
    y = np.arange(len(shown))
    ax.barh(y + 0.2, [c.ap for c in shown], height=0.4, label="AP", color="#4c78a8")
    ax.barh(y - 0.2, [c.f1 for c in shown], height=0.4, label="F1 at its threshold", color="#f58518")
    ax.set_yticks(y, [printable(c.name)[:30] for c in shown], fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_title(f"mAP {report.metrics['mAP']:.3f}, macro F1 {report.metrics['macro_f1']:.3f} on {report.images} "
                 "images", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # outside: no bar hidden
    return write_output(Path(path), lambda f: fig.savefig(f, format="png"), force=force)
