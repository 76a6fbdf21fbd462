"""``confusion.png``: a confusion matrix (rows: true classes, columns: predicted) with its class names.

With few classes (at most :data:`MAX_SHOWN` that have images or predictions) the whole matrix of
those classes; with more (ImageNet's 1000) the sub-matrix of the classes in the most confused
pairs, taken pair after pair until :data:`MAX_SHOWN` classes: where the model fails, readable.
Rows are true classes, columns predicted ones; a cell's colour is its share of the true class's
images (so rows of classes with different sizes compare), its number the image count.

Needs matplotlib (the ``plots`` extra), drawn on a ``Figure`` of its own with the Agg canvas (no
``pyplot``, as :mod:`convnets.train.curves`), written atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from convnets.errors import MissingDependencyError
from convnets.extras import install_hint
from convnets.fileio import write_output

__all__ = ["DPI", "FIGSIZE", "MAX_SHOWN", "agg_figure", "plot_confusion", "shown_classes"]

#: Figure size in inches and resolution: a 1000 x 900 pixel PNG.
FIGSIZE = (10.0, 9.0)
DPI = 100
#: Most classes drawn.
MAX_SHOWN = 25


def shown_classes(confusion: npt.NDArray[Any], pairs: list[tuple[int, int]], limit: int = MAX_SHOWN) -> list[int]:
    """The classes the figure shows, in class order.

    Args:
        confusion: ``[true, predicted]`` counts.
        pairs: ``(true, predicted)`` of the most confused pairs, most frequent first.
        limit: most classes.
    """
    involved = np.flatnonzero(confusion.sum(0) + confusion.sum(1))
    if len(involved) <= limit:
        return [int(i) for i in involved]
    chosen: list[int] = []
    for t, p in pairs:
        new = [c for c in (t, p) if c not in chosen]
        if len(chosen) + len(new) > limit:
            break
        chosen += new
    if not chosen:  # no confusion at all among too many classes: the largest ones
        chosen = [int(i) for i in np.argsort(-confusion.sum(1), kind="stable")[:limit]]
    return sorted(chosen)


def agg_figure(what: str, **options: Any) -> Any:
    """A matplotlib ``Figure`` of its own on the Agg canvas (no ``pyplot``), constrained layout.

    Args:
        what: the file it is for, named in the error when matplotlib is missing.
        **options: ``Figure``'s (``figsize``, ``dpi``).

    Raises:
        MissingDependencyError: matplotlib is not installed (naming the ``plots`` extra).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(
            f"matplotlib is needed to draw {what} but cannot be imported ({e}); install the 'plots' "
            f"extra: {install_hint('plots')}") from e
    fig = Figure(layout="constrained", **options)
    FigureCanvasAgg(fig)
    return fig


def plot_confusion(confusion: npt.NDArray[Any], names: Sequence[str], path: str | Path, *, summary: str = "",
                   force: bool = False) -> Path:
    """Draw a confusion (sub-)matrix into the PNG ``path``.

    Args:
        confusion: ``[true, predicted]`` image counts, ``C x C``.
        names: the ``C`` class names.
        path: the PNG to write (atomically; never through a symbolic link).
        summary: ends the title, e.g. ``"top-1 81.20% on 50000 images"``.
        force: replace ``path`` if it exists (else refused).

    Returns:
        ``path``.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        InvalidArgumentError: ``path`` exists (without ``force``).
    """
    fig = agg_figure(Path(path).name, figsize=FIGSIZE, dpi=DPI)
    cm = np.asarray(confusion)
    # Pairs beyond the report's list only matter when they add classes: take them from the matrix.
    off = cm.copy()
    np.fill_diagonal(off, 0)
    flat = np.flatnonzero(off)
    order = flat[np.argsort(-off.ravel()[flat], kind="stable")]
    pairs = [divmod(int(k), cm.shape[0]) for k in order]
    shown = shown_classes(cm, pairs)
    shown_names = [names[i] for i in shown]
    sub = cm[np.ix_(shown, shown)]
    support = cm.sum(1)[shown].astype(float)
    share = np.divide(sub, support[:, None], out=np.zeros(sub.shape), where=support[:, None] > 0)

    ax = fig.subplots()
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.8, label="share of the true class's images")
    ticks = np.arange(len(shown))
    ax.set_xticks(ticks, [_short(n) for n in shown_names], rotation=60, ha="right", fontsize=8)
    ax.set_yticks(ticks, [_short(n) for n in shown_names], fontsize=8)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    for (i, j), count in np.ndenumerate(sub):
        if count:
            ax.text(j, i, str(count), ha="center", va="center", fontsize=7,
                    color="white" if share[i, j] > 0.5 else "black")
    involved = int(np.count_nonzero(cm.sum(0) + cm.sum(1)))
    what = (f"all {len(shown)} classes" if len(shown) == involved else
            f"the {len(shown)} classes of the most confused pairs (of {involved} involved)")
    ax.set_title(f"confusion: {what}" + (f"; {summary}" if summary else ""))
    return write_output(path, lambda f: fig.savefig(f, format="png"), force=force)


def _short(name: Any, width: int = 22) -> str:
    text = str(name)
    return text if len(text) <= width else text[: width - 1] + "…"
