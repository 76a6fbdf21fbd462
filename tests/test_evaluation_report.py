"""The evaluation report's metrics are declared once (``METRICS``): report.json, the printed
table and the report's attributes come from that declaration, so a metric added there appears in
all three without another file changing. Synthetic totals, no model or torch."""

from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pytest

from convnets.evaluation.report import METRICS, EvalTotals, EvaluationReport, Metric


def _report() -> EvaluationReport:
    cm = np.array([[5, 1, 0], [2, 3, 1], [0, 0, 0]])  # the third class has no images
    return EvaluationReport.from_totals(EvalTotals(4.2, 8, 11, 12, 1, cm), ["a", "b", "c"], ["a", "b", "c"])


def test_every_declared_metric_is_in_the_json_the_table_and_an_attribute() -> None:
    report = _report()
    data = json.loads(report.to_json())
    summary = report.table().splitlines()[2]  # after the header and the unreadable-images line
    for m in METRICS:
        assert data[m.key] == pytest.approx(getattr(report, m.key)) == pytest.approx(report.metrics[m.key])
        assert m.shown.format(report.metrics[m.key]) in summary
    assert list(report.metrics) == [m.key for m in METRICS]
    assert summary == ("top-1 66.67%   top-5 91.67%   loss 0.3500   macro precision 0.732 recall 0.667 F1 0.685 "
                       "(2 classes with images)")


def test_a_metric_added_to_the_declaration_reaches_json_and_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import convnets.evaluation.report as report_module

    extra = Metric("images_seen", "seen {:.0f}", lambda c: float(c.images))
    monkeypatch.setattr(report_module, "METRICS", (*METRICS, extra))
    report = _report()
    assert report.images_seen == 12 and json.loads(report.to_json())["images_seen"] == 12
    assert "   seen 12 (2 classes with images)" in report.table()


def test_unknown_attributes_fail_and_copies_keep_the_metrics() -> None:
    report = _report()
    with pytest.raises(AttributeError, match="top_1"):
        report.top_1  # noqa: B018
    for clone in (copy.deepcopy(report), pickle.loads(pickle.dumps(report))):
        assert clone.top1 == report.top1 and clone.metrics == report.metrics
