"""``OUT/curves.png``: loss and top-1 accuracy against epoch, drawn from ``metrics.jsonl``.

Written at the end of ``convnets train`` (rank 0) and by ``convnets plot OUT``. Needs matplotlib
(the ``plots`` extra), imported only when drawing, with its Agg canvas on a ``Figure`` of its own:
no ``pyplot``, so the caller's matplotlib backend and global figures are left alone. No PyTorch.

The loop records no training accuracy (under MixUp it is not defined), so the accuracy panel shows
validation top-1 (and the EMA's with ``--ema``) and says so; a ``train_top1`` key, if a record has
one, is drawn too. A multi-label run (``train --multilabel``) records validation mAP instead, which
the right panel then shows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from convnets.errors import InvalidArgumentError, MissingDependencyError
from convnets.extras import install_hint
from convnets.fileio import write_output
from convnets.train.metrics import METRICS, read_metrics

__all__ = ["CURVES", "DPI", "FIGSIZE", "plot_curves", "write_curves"]

#: File name of the figure in the run's output directory.
CURVES = "curves.png"
#: Figure size in inches and resolution: a 1000 x 400 pixel PNG.
FIGSIZE = (10.0, 4.0)
DPI = 100

#: (panel title, y label, [(record key, legend label, line style)]) per panel, left to right. Each
#: series keeps its colour in both panels: train C0 (blue), validation C1 (orange), EMA C2 (green).
_PANELS: list[tuple[str, str, list[tuple[str, str, str]]]] = [
    ("loss", "cross-entropy", [
        ("train_loss", "train", "C0-"), ("val_loss", "validation", "C1-"),
        ("ema_val_loss", "validation (EMA)", "C2--")]),
    ("top-1 accuracy", "top-1 (%)", [
        ("train_top1", "train", "C0-"), ("val_top1", "validation", "C1-"),
        ("ema_val_top1", "validation (EMA)", "C2--")]),
]
#: The right panel of a multi-label run (``train --multilabel``), which records mAP instead of top-1.
_MULTILABEL_PANEL = ("validation mAP", "mAP", [("val_mAP", "validation", "C1-"), ("ema_val_mAP", "validation (EMA)",
                                                                                   "C2--")])


def _require_matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise MissingDependencyError(
            f"matplotlib is needed to draw {CURVES} but cannot be imported ({e}); install the 'plots' extra: "
            f"{install_hint('plots')}") from e
    return Figure, FigureCanvasAgg, MaxNLocator


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def plot_curves(records: Sequence[Mapping[str, Any]], path: Path, *, title: str | None = None,
                force: bool = False) -> Path:
    """Draw loss and top-1 against epoch from ``metrics.jsonl`` records into the PNG ``path``.

    Args:
        records: the per-epoch records (at least one, each with ``epoch``).
        path: the PNG to write (atomically: a reader sees the old figure or the new one; never
            through a symbolic link).
        title: the figure's title (e.g. the run's directory).
        force: replace ``path`` if it exists (else refused).

    Returns:
        ``path``.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        InvalidArgumentError: no record to draw; ``path`` exists (without ``force``).
    """
    if not records:
        raise InvalidArgumentError(f"no epoch recorded yet: nothing to draw in {path}")
    Figure, FigureCanvasAgg, MaxNLocator = _require_matplotlib()
    epochs = [int(r["epoch"]) for r in records]
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    panels = [_PANELS[0], _MULTILABEL_PANEL] if any("val_mAP" in r for r in records) else _PANELS
    for ax, (name, ylabel, series) in zip(fig.subplots(1, 2), panels):
        drawn = []
        for key, label, style in series:
            if any(key in r for r in records):
                ax.plot(epochs, [_number(r.get(key)) for r in records], style, marker="o", markersize=3, label=label)
                drawn.append(key)
        if name == "loss" and _spans_decades(records, [key for key, _, _ in series]):
            ax.set_yscale("log")  # a first epoch's loss far above the rest would flatten every curve
            ylabel += " (log scale)"
        if name == "top-1 accuracy":
            _mark_best(ax, epochs, [_number(r.get("val_top1")) for r in records])
            if "train_top1" not in drawn:
                name += " (no training accuracy recorded)"
        if name == "validation mAP":
            _mark_best(ax, epochs, [_number(r.get("val_mAP")) for r in records], "{:.4f}")
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend()
    if title:
        fig.suptitle(title)
    return write_output(path, lambda f: fig.savefig(f, format="png"), force=force)


def _spans_decades(records: Sequence[Mapping[str, Any]], keys: list[str]) -> bool:
    values = [v for r in records for v in (_number(r.get(k)) for k in keys) if math.isfinite(v)]
    return bool(values) and min(values) > 0 and max(values) / min(values) > 20


def _mark_best(ax: Any, epochs: list[int], top1: list[float], shown: str = "{:.2f}%") -> None:
    finite = [(v, e) for e, v in zip(epochs, top1) if math.isfinite(v)]
    if finite:
        best, epoch = max(finite, key=lambda p: (p[0], -p[1]))  # the first epoch reaching the best
        ax.plot([epoch], [best], "*", color="black", markersize=10,
                label=f"best {shown.format(best)} (epoch {epoch})")


def write_curves(output: Path, path: Path | None = None, *, force: bool = False) -> Path:
    """Draw ``output/curves.png`` (or ``path``) from ``output/metrics.jsonl``.

    Args:
        output: a ``convnets train`` output directory.
        path: where to write the PNG (default ``output/curves.png``).
        force: replace the PNG if it exists (else refused; the training run redraws its own).

    Returns:
        The PNG's path.

    Raises:
        InvalidArgumentError: ``output`` holds no ``metrics.jsonl`` or no epoch in it; the PNG exists
            (without ``force``).
        DataError: a line of ``metrics.jsonl`` is not a JSON record.
        MissingDependencyError: matplotlib is not installed.
    """
    output = Path(output)
    metrics = output / METRICS
    if not metrics.is_file():
        raise InvalidArgumentError(f"{output} holds no {METRICS}; give the output directory of a convnets train run")
    records = read_metrics(metrics)
    if not records:
        raise InvalidArgumentError(f"{metrics} records no finished epoch yet; nothing to draw")
    return plot_curves(records, path if path is not None else output / CURVES, title=str(output), force=force)
