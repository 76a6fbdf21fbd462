"""The benchmark charts, drawn with matplotlib from ``benchmarks/results/*.json`` when the site is built.

:data:`CHARTS` names the results files that have a chart and the function that draws it. The hooks
(``docs/hooks.py``) add ``charts/NAME.svg`` to the built site for each results file that exists and
put the image under that file's table. Nothing here is committed: a chart is redrawn at every build.

Each SVG says where it comes from, in its metadata (``<dc:source>``: the results file;
``<dc:identifier>``: ``sha256:`` of that file's bytes), and carries its numbers as text (each bar is
labelled with its value; ``svg.fonttype: none`` keeps text as ``<text>``), so that
``tests/test_docs_charts.py`` checks that the chart on the site was drawn from the file it names, as
it is now.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: Where a chart goes in the built site: ``charts/NAME.svg``.
CHART_DIR = "charts"
#: One colour per precision (fp32 the reference's), the same on every chart.
COLOURS = {"fp32": "#1f77b4", "bf16": "#ff7f0e", "fp16": "#2ca02c", "int8": "#9467bd"}


def digest(path: Path) -> str:
    """``sha256:HEX`` of the file's bytes: what a chart records as its source's identity."""
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def value_label(value: float) -> str:
    """How a bar's value is written on it (img/s or seconds): 3 significant figures."""
    return f"{value:.3g}"


def _words(variant: str) -> tuple[str, str]:
    """``("openvino", "bf16")`` for ``"openvino bf16"``, ``"auto bf16 (openvino)"``, ``"timm fp32"``."""
    words = variant.split()
    return words[0], words[1] if len(words) > 1 else ""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: the build may run anywhere
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, labels: Sequence[str], groups: Mapping[str, Sequence[float | None]],
          spread: Mapping[str, Sequence[tuple[float, float] | None]], ylabel: str,
          colours: Mapping[str, str] = COLOURS) -> None:
    """Grouped bars: one group per label, one bar per key of ``groups`` (its colour from ``colours``,
    else the next of matplotlib's cycle), each bar labelled with its value, with its rounds' min-max
    as an error bar."""
    keys = list(groups)
    width = 0.8 / max(len(keys), 1)
    for i, key in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(labels))]
        points = [(x, v, s) for x, v, s in zip(xs, groups[key], spread[key]) if v is not None]
        if not points:
            continue
        x, v, s = zip(*points)
        err = [[max(0.0, val - lo) for val, (lo, _) in zip(v, s)], [max(0.0, hi - val) for val, (_, hi) in zip(v, s)]]
        bars = ax.bar(x, v, width * 0.92, yerr=err, capsize=2, label=key, color=colours.get(key, f"C{i}"))
        ax.bar_label(bars, labels=[value_label(val) for val in v], fontsize=7, padding=2)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)


def engines_chart(r: Mapping[str, Any]) -> Any:
    """Engines x precision: img/s per engine, a bar per precision, a panel per model and batch."""
    plt = _pyplot()
    panels = list(dict.fromkeys((row["model"], row["batch_size"]) for row in r["rows"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False, sharey=False)
    for ax, (model, batch) in zip(axes[0], panels):
        rows = [row for row in r["rows"] if (row["model"], row["batch_size"]) == (model, batch)
                and len(row["variant"].split("(")[0].split()) == 2]  # no engine settings
        engines = list(dict.fromkeys(_words(row["variant"])[0] for row in rows))
        precisions = list(dict.fromkeys(_words(row["variant"])[1] for row in rows))
        speed = {(_words(row["variant"])): row for row in rows}
        groups = {p: [speed[(e, p)]["img_per_s"] if (e, p) in speed else None for e in engines] for p in precisions}
        spread = {p: [_min_max(speed[(e, p)]["img_per_s_all_rounds"]) if (e, p) in speed else None
                      for e in engines] for p in precisions}
        _bars(ax, engines, groups, spread, "img/s (median of rounds)")
        plt.setp(ax.get_xticklabels(), rotation=20, ha="right")  # "onnxruntime" beside "openvino"
        ax.set_title(f"{model}, batch {batch}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    return fig


def _min_max(values: Sequence[float]) -> tuple[float, float]:
    return min(values), max(values)


def batch_chart(r: Mapping[str, Any]) -> Any:
    """Batch-size scaling: img/s per batch size, a bar per variant, a panel per model."""
    plt = _pyplot()
    models = list(dict.fromkeys(row["model"] for row in r["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [row for row in r["rows"] if row["model"] == model]
        batches = sorted({row["batch_size"] for row in rows})
        variants = list(dict.fromkeys(row["variant"] for row in rows))
        by = {(row["variant"], row["batch_size"]): row for row in rows}
        groups = {v: [by[(v, b)]["img_per_s"] if (v, b) in by else None for b in batches] for v in variants}
        spread = {v: [_min_max(by[(v, b)]["img_per_s_all_rounds"]) if (v, b) in by else None for b in batches]
                  for v in variants}
        _bars(ax, [f"batch {b}" for b in batches], groups, spread, "img/s (median of rounds)", colours={})
        values = [v for g in groups.values() for v in g if v is not None]
        if values and max(values) / min(values) > 20:  # a GPU's batch 1 and 256 on one axis
            ax.set_yscale("log")
        ax.set_title(model, fontsize=9)
        ax.legend(fontsize=6, loc="upper left")
    return fig


def first_prediction_chart(r: Mapping[str, Any]) -> Any:
    """Time to the first prediction: seconds per variant (median, min-max), and the target."""
    plt = _pyplot()
    rows = r["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 0.5 + 0.55 * len(rows)))
    names = [row["variant"] for row in rows]
    medians = [row["median_s"] for row in rows]
    lo = [row["median_s"] - min(row["seconds_all_rounds"]) for row in rows]
    hi = [max(row["seconds_all_rounds"]) - row["median_s"] for row in rows]
    bars = ax.barh(names, medians, xerr=[lo, hi], capsize=3, color=COLOURS["fp32"])
    ax.bar_label(bars, labels=[value_label(v) + " s" for v in medians], fontsize=7, padding=4)
    torch_s = next((row["median_s"] for row in rows if row["variant"] == "torch"), None)
    if torch_s is not None:
        ax.axvline(torch_s * r["target_ratio"], color=COLOURS["bf16"], linestyle="--",
                   label=f"target: {r['target_ratio']}x torch")
        ax.legend(fontsize=7, loc="lower right")
    ax.invert_yaxis()
    ax.set_xlabel("seconds to the first JSON line (median of rounds)")
    ax.margins(x=0.15)
    return fig


#: results name -> the function that draws its chart from the file's ``results``.
CHARTS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "bench_first_prediction": first_prediction_chart,
    "bench_inference": batch_chart,
    "bench_inference_cuda": batch_chart,
    "bench_inference_resnet50": batch_chart,
    "bench_engines": engines_chart,
    "bench_engines_resnet50": engines_chart,
    "bench_engines_int8": engines_chart,
}


def chart_svg(name: str, path: Path, source: str) -> bytes:
    """The SVG of ``name``'s chart drawn from the results file ``path``; ``source`` is how the
    metadata names that file (``benchmarks/results/NAME.json``)."""
    plt = _pyplot()
    record = json.loads(path.read_text(encoding="utf-8"))
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": name, "font.size": 8}):
        fig = CHARTS[name](record["results"])
        fig.suptitle(f"{record['date']}: {record['machine'].get('device_name') or record['machine']['cpu_model']}",
                     fontsize=7, x=0.99, ha="right")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="svg", metadata={"Title": f"{name} chart", "Source": source,
                                                 "Identifier": digest(path), "Date": None})
        plt.close(fig)
    return out.getvalue()


def image_markdown(name: str) -> str:
    """The image line under ``name``'s table (a link relative to a page at the top of ``docs/``)."""
    return f"![Chart of {name}.json]({CHART_DIR}/{name}.svg)"
