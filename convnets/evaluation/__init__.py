"""Measure a classifier on a labelled image set: ``convnets evaluate`` / :func:`evaluate_model`.

* :mod:`~convnets.evaluation.data`: the dataset layouts (class folders, flat + Kaggle CSV, flat +
  devkit, a labels file) mapped to the model's class order;
* :mod:`~convnets.evaluation.loop`: :func:`accumulate`, the one evaluation loop (also behind training's
  validation), and :func:`evaluate_model`;
* :mod:`~convnets.evaluation.report`: :class:`EvaluationReport`: its metrics (declared once, in
  ``METRICS``), ``report.json`` and the printed table;
* :mod:`~convnets.evaluation.multilabel`: :class:`MultiLabelReport`, a multi-label model's figures (mAP,
  micro-AP, F1 at its thresholds), :func:`choose_thresholds` (training's) and ``ap.png``;
* :mod:`~convnets.evaluation.confusion`: ``confusion.png`` from a confusion matrix and class names.

PyTorch is imported on first use of a name that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.lazy import lazy_getattr

if TYPE_CHECKING:
    from convnets.evaluation.loop import evaluate_model
    from convnets.evaluation.multilabel import MultiLabelReport
    from convnets.evaluation.report import EvaluationReport

__all__ = ["EvaluationReport", "MultiLabelReport", "evaluate_model"]

__getattr__ = lazy_getattr(__name__, {"EvaluationReport": "report", "MultiLabelReport": "multilabel",
                                      "evaluate_model": "loop"})
