"""MkDocs hooks: the pages' generated parts, made from the code and the measurements at build time.

* ``<!-- cli-reference -->`` becomes, for ``convnets`` and each subcommand, a heading and its
  ``--help`` text, taken from the argparse parsers themselves (:func:`cli_reference`): a new option
  appears on the site without editing it. ``<!-- cli-commands -->`` becomes a table of the
  subcommands with their one-line help, each linked to its reference (:func:`cli_commands`).
* ``<!-- results: NAME -->`` becomes the table of ``benchmarks/results/NAME.json`` (written by
  ``benchmarks/NAME.py`` through ``benchmarks/results.py``), then one line saying when, on what and
  with which command it was measured (:func:`render_results`). The results folder is
  ``$CONVNETS_RESULTS_DIR`` when set (tests use it), else ``benchmarks/results/``. A file that does not
  exist yet gives a "Not measured yet" note (logged at INFO, so ``--strict`` passes); a file that
  exists but does not have the shape its renderer expects fails the build.
  Under the tables that have one, a chart drawn from the same file (``docs/charts.py``; the
  SVGs are added to the site by :func:`on_files`, never committed).
* ``<!-- model-cards -->`` becomes a card per registered model (``docs/cards.py``): accuracy and
  file size from the manifest, parameters and GFLOPs counted on the model, recipe, eval transform,
  and a line from each results file that measured it.
* ``<!-- notebook: PATH -->`` becomes the cells of the Jupyter notebook ``PATH`` (relative to the
  repository): its Markdown cells as they are, its code cells as Python blocks
  (:func:`render_notebook`). The notebook is stored without outputs, so the page shows what a user
  runs; ``tests/test_notebook.py`` runs it.
* :class:`ReadableDocstrings`, a Griffe extension (``mkdocs.yml``: the python handler's
  ``extensions``), makes the docstrings, written for ``help()`` and Sphinx, parse as Google style.

Configured in ``mkdocs.yml`` (``hooks:``); the functions are plain Python, so that
``tests/test_docs_build.py`` calls them directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("mkdocs.hooks.convnets")  # under "mkdocs": shown, and counted by --strict

CLI_MARKER = "<!-- cli-reference -->"
COMMANDS_MARKER = "<!-- cli-commands -->"
RESULTS_MARKER = re.compile(r"<!--\s*results:\s*([\w.-]+)\s*-->")
RESULTS_DIR_ENV = "CONVNETS_RESULTS_DIR"
NOTEBOOK_MARKER = re.compile(r"<!--\s*notebook:\s*(\S+)\s*-->")
#: The terminal width the ``--help`` texts are wrapped at, whatever terminal builds the site.
HELP_COLUMNS = 100


class DocsError(Exception):
    """A page's generated part cannot be made (an unknown marker, a malformed results file)."""


def _fail(message: str) -> Exception:
    """The error that stops the build with ``message`` (MkDocs' own, when MkDocs runs us)."""
    try:
        from mkdocs.exceptions import PluginError
    except ImportError:  # called from the tests without MkDocs
        return DocsError(message)
    return PluginError(message)


def _sibling(name: str) -> Any:
    """The module ``docs/NAME.py`` (``docs/`` is not a package, and MkDocs loads this file by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"convnets_docs_{name}", Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


charts = _sibling("charts")
cards = _sibling("cards")


# --- the CLI reference -------------------------------------------------------------------------


@contextmanager
def fixed_terminal(columns: int = HELP_COLUMNS) -> Iterator[None]:
    """argparse wraps help at ``$COLUMNS`` (and, from Python 3.14, colours it for a terminal): fix both."""
    saved = {name: os.environ.get(name) for name in ("COLUMNS", "NO_COLOR", "FORCE_COLOR")}
    os.environ["COLUMNS"] = str(columns)
    os.environ["NO_COLOR"] = "1"
    os.environ.pop("FORCE_COLOR", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import(module: str) -> Any:
    """``module`` of the checkout being built, also when another copy is installed (``pip install -e``
    of a different checkout): ``mkdocs`` started as a console script does not have the working
    directory on ``sys.path``, and MkDocs restores ``sys.path`` after loading this file."""
    import importlib

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    imported = importlib.import_module(module)
    where = Path(getattr(imported, "__file__", "") or "").resolve()
    if ROOT not in where.parents:
        log.warning("documenting %s from %s, not from the checkout being built (%s)", module, where, ROOT)
    return imported


def _subcommands() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The top-level parser (every command's options) and its subcommands' action."""
    parser = _import("convnets.cli").build_parser()
    return parser, next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def cli_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """``("convnets", top-level parser)``, then ``("convnets COMMAND", its parser)`` per subcommand."""
    parser, sub = _subcommands()
    commands = _import("convnets.cli").COMMANDS
    return [("convnets", parser), *((f"convnets {name}", sub.choices[name]) for name in commands)]


def cli_commands() -> str:
    """The Markdown that replaces :data:`COMMANDS_MARKER`: each subcommand, linked to its reference, and its help."""
    _, sub = _subcommands()
    rows = [[f"[`convnets {a.dest}`](cli.md#convnets-{a.dest})", a.help] for a in sub._choices_actions]
    return table(["command", "what it does"], rows)


def help_text(parser: argparse.ArgumentParser) -> str:
    """``parser.format_help()`` at :data:`HELP_COLUMNS` columns, without colour."""
    with fixed_terminal():
        return parser.format_help()


def _fence(text: str, info: str = "text") -> str:
    """``text`` in a fenced code block whose fence no backtick run inside it can close."""
    runs = [len(m) for m in re.findall(r"`+", text)]
    fence = "`" * max(3, max(runs, default=0) + 1)
    return f"{fence}{info}\n{text.rstrip()}\n{fence}"


def cli_reference() -> str:
    """The Markdown that replaces :data:`CLI_MARKER`: a heading and the ``--help`` text per command."""
    sections = []
    for title, parser in cli_parsers():
        sections.append(f"## `{title}`\n\n{_fence(help_text(parser))}\n")
    return "\n".join(sections)


# --- the benchmark tables ------------------------------------------------------------------------


def results_dir() -> Path:
    """Where the results files are read from: ``$CONVNETS_RESULTS_DIR``, else ``benchmarks/results/``."""
    value = os.environ.get(RESULTS_DIR_ENV)
    return Path(value) if value else ROOT / "benchmarks" / "results"


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[object]], align: Sequence[str] | None = None) -> str:
    """A Markdown table; ``align`` per column: ``"l"`` (default) or ``"r"``."""
    align = align or ["l"] * len(header)
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _range(values: Sequence[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def _ratio(median: float, lo: float, hi: float) -> list[str]:
    """A ratio's two cells: the median (``1.23x``) and its rounds' range (``1.10-1.31``), each in its
    own column so that neither wraps."""
    return [f"{median:.2f}x", f"{lo:.2f}-{hi:.2f}"]


def render_first_prediction(r: Mapping[str, Any]) -> str:
    rows = []
    for row in r["rows"]:
        seconds, ratios = row["seconds_all_rounds"], row["ratio_to_torch_all_rounds"]
        rows.append([row["variant"], f"{row['median_s']:.2f}", f"{min(seconds):.2f}", f"{max(seconds):.2f}",
                     *_ratio(statistics.median(ratios), min(ratios), max(ratios))])
    verdict = "met" if r["warm_auto_ratio"] <= r["target_ratio"] else "not met"
    return (table(["variant", "median s", "min s", "max s", "vs torch (median)", "rounds"], rows, "lrrrrr")
            + f"\n\nWarm `auto` / `torch`: {r['warm_auto_ratio']:.2f}x (target at most {r['target_ratio']}x: "
              f"{verdict}). {r['model']}, one {r['image']}, {r['rounds']} rounds.")


def render_fast_decode(r: Mapping[str, Any]) -> str:
    parts = []
    if r["pixels"]:
        rows = [[p["variant"], f"{p['mean_abs_diff']:.4f}", f"{p['max_abs_diff']:.3f}",
                 f"{p['ms_per_image']:.0f}", _range(p["ms_all_rounds"], 0), f"{p['cpu_ms_per_image']:.0f}"]
                for p in r["pixels"]]
        parts.append("Pixels against the exact path (normalised units), preprocessing on one thread:\n\n"
                     + table(["variant", "mean abs diff", "max abs diff", "wall ms/image (median)", "rounds",
                              "CPU ms/image"], rows, "lrrrrr"))
    rows = [[label, f"{statistics.median(values):.2f}", ", ".join(f"{v:.2f}" for v in values)]
            for label, values in r["end_to_end"].items()]
    eager = "" if r.get("compile", True) else " (not compiled)"  # files before 2026-11-26 compiled always
    parts.append(f"End to end: `predict`, {r['model']} {r['precision']}{eager}, batch {r['batch_size']}, "
                 f"workers {r['workers']}; {r['images']} JPEGs of 4032x3024 ({r['image_mb']:.1f} MB); "
                 f"median of {r['rounds']} interleaved rounds:\n\n"
                 + table(["variant", "img/s", "all rounds"], rows, "lrl"))
    parts.append(f"Speed-up fast / exact: {r['speedup_median']:.2f}x ({_range(r['speedup'])}).")
    return "\n\n".join(parts)


def render_decode(r: Mapping[str, Any]) -> str:
    rows = [[row["set"], row["variant"], f"{row['img_per_s']:.1f}", *_ratio(row["vs_model_only"],
                                                                           *row["vs_model_only_min_max"])]
            for row in r["rows"]]
    sizes = ", ".join(f"{name} {w}x{h} ({r['images'][name]} JPEGs)" for name, (w, h) in r["sizes"].items())
    compiled = " compiled" if r["compile"] else ""
    verdicts = "; ".join(f"{name}: {v['device_vs_model_only']:.2f}x model only (target {v['target']}: "
                         f"{'met' if v['met'] else 'not met'})" for name, v in r["verdicts"].items())
    agreement = table(["photos", "images", "top-1 agreement", "min cosine", "max abs diff", "mean abs diff"],
                      [[name, str(a["images"]), f"{100 * a['top1_agreement']:.1f} %", f"{a['min_cosine']:.5f}",
                        f"{a['max_abs_diff']:.3f}", f"{a['mean_abs_diff']:.4f}"] for name, a in r["agreement"].items()],
                      "lrrrrr")
    return (f"{r['model']} {r['precision']}{compiled}, batch {r['batch_size']}, {r['workers']} workers; {sizes}; "
            f"median of {r['rounds']} interleaved rounds:\n\n"
            + table(["set", "variant", "img/s", "vs model only", "rounds"], rows, "llrrr")
            + f"\n\nDevice decode: {verdicts}.\n\nThe device path against the Pillow path (logits of the same "
              f"model; pixels in normalised units):\n\n" + agreement)


def render_cli(r: Mapping[str, Any]) -> str:
    rows = [[f"`{row['case']}`", f"{row['median_s']:.3f}", f"{row['ratio_to_reference']:.2f}"] for row in r["rows"]]
    verdict = "meets" if r["slowest_ratio"] < r["target_ratio"] else "misses"
    return (table(["case", "median (s)", f"x {r['reference']}"], rows, "lrr")
            + f"\n\nSlowest CLI case: {r['slowest_ratio']:.2f}x `{r['reference']}` ({verdict} the target "
              f"< {r['target_ratio']}x); median of {r['rounds']} interleaved rounds, fresh processes.")


#: A line of ``bench_engines.py``'s ``ratio_verdicts``: one variant's speed over its baseline's.
_RATIO_VERDICT = re.compile(r"^(?P<model>\S+) b(?P<batch>\d+): (?P<label>.+) / (?P<baseline>.+) = "
                            r"(?P<ratio>[\d.]+)x \(rounds (?P<lo>[\d.]+)-(?P<hi>[\d.]+)\)$")


def _speed_table(r: Mapping[str, Any], ratio_verdicts: Sequence[str] = ()) -> str:
    """img/s per batch and variant with the speed-up over timm fp32 or, where ``ratio_verdicts``
    compare variants with a baseline, over that baseline; a table per model (six columns: Material
    gives every column at least 100 px of a 688 px text column at a 1280 px window)."""
    versus: dict[tuple[str, int, str], tuple[str, list[str]]] = {}
    for line in ratio_verdicts:
        m = _RATIO_VERDICT.match(line)
        if m is None:
            raise ValueError(f"unreadable ratio verdict {line!r}")
        versus[(m["model"], int(m["batch"]), m["label"])] = (
            m["baseline"], _ratio(float(m["ratio"]), float(m["lo"]), float(m["hi"])))
    settings = any(len(row["variant"].split("(")[0].split()) > 2 for row in r["rows"])
    baselines = sorted({baseline for baseline, _ in versus.values()})
    versus_header = ("vs defaults" if settings else f"vs {' / '.join(baselines)}") if versus else "vs timm fp32"
    header = ["batch", "variant", "img/s", versus_header, "rounds", "warm-up s"]
    models = list(dict.fromkeys(row["model"] for row in r["rows"]))
    tables = []
    for model in models:
        rows = []
        for row in (row for row in r["rows"] if row["model"] == model):
            if versus:
                ratio = versus.get((model, row["batch_size"], row["variant"]), ("", ["", ""]))[1]
            else:
                ratio = _ratio(row["speedup_vs_timm"], *row["speedup_min_max"])
            words = row["variant"].split(" ")
            # Engine settings as code: a long KEY=VALUE may break anywhere (docs/stylesheets/tables.css).
            variant = f"{' '.join(words[:2])} `{' '.join(words[2:])}`" if settings and len(words) > 2 else row["variant"]
            rows.append([row["batch_size"], variant, f"{row['img_per_s']:.2f}", *ratio, f"{row['warmup_s']:.1f}"])
        tables.append((f"`{model}`:\n\n" if len(models) > 1 else "") + table(header, rows, "rlrrrr"))
    return "\n\n".join(tables)


def _models(r: Mapping[str, Any]) -> str:
    """``"resnet50, "`` where a speed table has one model (and so no model column)."""
    models = list(dict.fromkeys(row["model"] for row in r["rows"]))
    return f"{models[0]}, " if len(models) == 1 else ""


def _load(r: Mapping[str, Any]) -> str:
    """`` (load average before and after: 1.2, 3.4)``, where the file records it (from 2026-11-26 on)."""
    load = r.get("load_average")
    return f" (load average before and after: {load[0]:.1f}, {load[1]:.1f})" if load else ""


def render_engines(r: Mapping[str, Any]) -> str:
    text = (f"{_models(r)}{r['image_size']} px, timm {r['timm']}, median of {r['rounds']} interleaved "
            f"rounds{_load(r)}:\n\n" + _speed_table(r, r["ratio_verdicts"]))
    verdicts = r["auto_verdicts"]
    return text + ("\n\n" + "\n".join(f"* {line}" for line in verdicts) if verdicts else "")


def render_inference(r: Mapping[str, Any]) -> str:
    return (f"{_models(r)}timm {r['timm']}, 224 px, median of {r['rounds']} interleaved rounds{_load(r)}:\n\n"
            + _speed_table(r))


def render_load(r: Mapping[str, Any]) -> str:
    rows = [[row["variant"], f"{row['seconds_median']:.3f}", f"{row['vs_baseline']:.2f}x",
             f"{row['rss_growth_mib']:.0f} MiB", f"{row['rss_over_file_size']:.2f}x"] for row in r["rows"]]
    return (f"{r['model']}, file {r['file_mib']:.0f} MiB, median of {r['rounds']} rounds, a fresh process each:\n\n"
            + table(["variant", "build s (median)", "vs baseline", "peak RSS growth", "/ file size"], rows, "lrrrr"))


def render_predict_pipeline(r: Mapping[str, Any]) -> str:
    rows = []
    for row in r["rows"]:
        lo, hi = row["vs_model_only_min_max"]
        where = "model 1 + decoder 1 (pinned)" if row["pinned"] else f"all {r['usable_cores']}"
        rows.append([row["precision"], where, row["variant"], f"{row['img_per_s']:.1f}",
                     *_ratio(row["vs_model_only"], lo, hi)])
    return (f"{r['model']}, {r['images']} JPEGs of 1000x750 ({r['image_kb']:.0f} KB), batch {r['batch_size']}; "
            f"median of {r['rounds']} interleaved rounds:\n\n"
            + table(["precision", "cores", "variant", "img/s", "vs model only", "rounds"], rows, "lllrrr"))


def render_preprocess(r: Mapping[str, Any]) -> str:
    rows = [[f"`{row['variant']}`", f"{row['median_s']:.3f}", f"{row['best_s']:.3f}", f"{row['cpu_s']:.3f}"]
            for row in r["rows"]]
    return (f"{r['photos']} JPEG photos ({r['size']} and similar, {r['megabytes']:.1f} MiB), "
            f"{r['usable_cores']} usable cores, load average {r['load_average']:.2f}; "
            f"{r['repeat']} interleaved runs:\n\n"
            + table(["variant", "median s", "best s", "CPU s (median)"], rows, "lrrr")
            + f"\n\nSpeed-up (median): {r['speedup_median']:.2f}x (best/best {r['speedup_best']:.2f}x); "
              f"max abs difference from upstream {r['max_abs_diff']:.3g}.")


def render_train(r: Mapping[str, Any]) -> str:
    rows = [[row["amp_dtype"] or "fp32", row["memory_format"], f"{row['img_per_s']:.1f}", f"{row['median_ms']:.1f}",
             f"{row['vs_fp32_nchw']:.2f}x"] for row in r["rows"]]
    arch = f"{r['arch']} (tiny: `{json.dumps(r['tiny_kwargs'])}`)" if r["tiny_kwargs"] else r["arch"]
    return (f"{arch}, batch {r['batch_size']}, {r['image_size']} px, {r['steps']} timed steps after {r['warmup']}; "
            f"{r['device_name']}:\n\n"
            + table(["precision", "layout", "img/s", "median step (ms)", "vs fp32 nchw"], rows, "llrrr"))


def render_serve(r: Mapping[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.0f}"
    rows = [[row["variant"], f"{row['img_per_s']:.2f}", *_ratio(row["vs_in_process"], *row["vs_in_process_min_max"]),
             " / ".join(filter(None, (ms(row["p50_ms"]), ms(row["p99_ms"])))),
             "" if row["mean_batch"] is None else f"{row['mean_batch']:.1f}"] for row in r["rows"]]
    worst = r["worst_ratio_from_8_clients"]
    verdict = "" if worst is None else (f"\n\nFrom 8 clients on, the median served throughput is at least "
                                        f"{worst:.2f}x in-process (target {r['target_ratio']}x: "
                                        f"{'met' if worst >= r['target_ratio'] else 'not met'}).")
    load = ", ".join(f"{v:.1f}" for v in r["load_average"])
    return (f"{r['model']} {r['precision']}, engine {r['engine']}, {r['requests']} {r['image']} images per "
            f"measurement, --max-batch-size {r['max_batch_size']}, --max-queue-delay-ms {r['queue_delay_ms']:g}; "
            f"median of {r['rounds']} interleaved rounds (load average before and after: {load}):\n\n"
            + table(["variant", "img/s", "vs in process", "rounds", "p50 / p99 ms", "mean batch"], rows,
                    "lrrrrr") + verdict + "\n\nWhat the front costs: " + _render_serve_front(r["front"]))


def _render_serve_front(r: Mapping[str, Any]) -> str:
    rows = [[f"{row['protocol']}, {row['clients']}", f"{row['front_per_s']:.0f} / {row['socket_per_s']:.0f}",
             *_ratio(row["ratio"], *row["ratio_min_max"]),
             f"{row['front_p50_p99_ms'][1]:.1f} / {row['socket_p50_p99_ms'][1]:.1f} ({row['p99_ratio']:.2f}x)",
             f"{100 * row['front_cpu_vs_triton']:.0f} %"] for row in r["rows"]]
    met = [row for row in r["rows"] if row["ratio"] >= r["target_ratio"] and row["p99_ratio"] <= 2 - r["target_ratio"]]
    ready = r["readiness_per_s"]
    load = ", ".join(f"{v:.1f}" for v in r["load_average"])
    return (f"{r['model']}, one {r['image']} per request, {r['requests']} requests per route and measurement "
            f"(at one client the routes alternate request by request); median of {r['rounds']} interleaved rounds, "
            f"p99 over all rounds (load average before and after: {load}):\n\n"
            + table(["protocol, clients", "req/s: front / socket", "ratio", "rounds", "p99 ms: front / socket",
                     "CPU: front / Triton"], rows, "lrrrrr")
            + f"\n\nThe front's cost is within {100 * (1 - r['target_ratio']):.0f} % (throughput and p99) in "
              f"{len(met)} of {len(r['rows'])} rows. `GET /v2/health/ready` from {r['readiness_clients']} clients: "
              f"{ready['front']:.0f} req/s through the front, {ready['socket']:.0f} on Triton's socket.")


def render_ray(r: Mapping[str, Any]) -> str:
    rows = [[f"`{row['variant']}`", f"{row['img_per_s']:.2f}", f"{row['seconds']:.0f}",
             f"{row['first_record_s']:.1f}", f"{row['after_first_img_per_s']:.2f}"] for row in r["rows"]]
    verdict = "met" if r["ratio"] >= r["target_ratio"] else "not met"
    load = ", ".join(f"{v:.1f}" for v in r["load_average"])
    return (f"{r['model']}, {r['images']} JPEGs of {r['image_size']}, batch {r['batch_size']}, "
            f"{r['rounds']} round(s) (load average before and after: {load}):\n\n"
            + table(["run", "img/s", "seconds", "first record after (s)", "img/s after it"], rows, "lrrrr")
            + f"\n\n`--ray local` / `predict`: {r['ratio']:.2f}x (target at least {r['target_ratio']}x: {verdict}); "
              f"the same top-5 for every image: {'yes' if r['same_top5'] else 'no'}.")


#: results name (``benchmarks/results/NAME.json``) -> (renderer of its ``results``, the command that makes it)
RENDERERS: dict[str, tuple[Callable[[Mapping[str, Any]], str], str]] = {
    "bench_first_prediction": (render_first_prediction, "python benchmarks/bench_first_prediction.py"),
    "bench_fast_decode": (render_fast_decode, "python benchmarks/bench_fast_decode.py"),
    "bench_fast_decode_cuda": (render_fast_decode, "python benchmarks/bench_fast_decode.py --device cuda"),
    "bench_cli": (render_cli, "python benchmarks/bench_cli.py"),
    "bench_decode": (render_decode, "python benchmarks/bench_decode.py --device cpu"),
    "bench_decode_cuda": (render_decode, "python benchmarks/bench_decode.py --device cuda"),
    "bench_engines": (render_engines, "python benchmarks/bench_engines.py"),
    "bench_engines_int8": (render_engines, "python benchmarks/bench_engines.py --int8"),
    "bench_engines_settings": (render_engines, "python benchmarks/bench_engines.py --settings"),
    "bench_engines_resnet50": (render_engines, "python benchmarks/bench_engines.py --models resnet50 --json "
                                               "benchmarks/results/bench_engines_resnet50.json"),
    "bench_inference": (render_inference, "python benchmarks/bench_inference.py"),
    "bench_inference_cuda": (render_inference, "python benchmarks/bench_inference.py --device cuda"),
    "bench_inference_resnet50": (render_inference, "python benchmarks/bench_inference.py --models resnet50 --json "
                                                   "benchmarks/results/bench_inference_resnet50.json"),
    "bench_load": (render_load, "python benchmarks/bench_load.py"),
    "bench_predict_pipeline": (render_predict_pipeline, "python benchmarks/bench_predict_pipeline.py"),
    "bench_preprocess": (render_preprocess, "python benchmarks/bench_preprocess.py"),
    "bench_serve": (render_serve, "python benchmarks/bench_serve.py"),
    "bench_ray": (render_ray, "python benchmarks/bench_ray.py"),
    "bench_train": (render_train, "python benchmarks/bench_train.py"),
    "bench_train_cuda": (render_train, "python benchmarks/bench_train.py --device cuda"),
}


def provenance(record: Mapping[str, Any]) -> str:
    """The line under a table: date, machine, torch version and the exact command."""
    m = record["machine"]
    where = f"{m['cpu_model']}, {m['cpu_count']} cores, {m['torch_threads']} threads"
    if str(m.get("device", "cpu")) != "cpu":
        where = f"{m['device_name']} (host: {where})"
    return f"Measured {record['date']} on {where}; torch {m['torch']}; `{record['command']}`."


def not_measured(name: str) -> str:
    command = RENDERERS[name][1]
    return (f'!!! note "Not measured yet"\n\n'
            f"    Not measured yet: run `{command}` (it writes `benchmarks/results/{name}.json`).\n")


def render_results(name: str, directory: Path | None = None) -> str:
    """The Markdown for ``<!-- results: NAME -->``: the table of ``NAME.json`` and its provenance line."""
    if name not in RENDERERS:
        raise _fail(f"<!-- results: {name} -->: no renderer for {name!r} in docs/hooks.py "
                    f"(known: {', '.join(sorted(RENDERERS))})")
    path = (directory or results_dir()) / f"{name}.json"
    if not path.is_file():
        log.info("%s does not exist: the page says 'Not measured yet'", path)
        return not_measured(name)
    renderer = RENDERERS[name][0]
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        chart = f"\n\n{charts.image_markdown(name)}" if name in charts.CHARTS else ""
        return f"{renderer(record['results'])}{chart}\n\n{provenance(record)}\n"
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise _fail(f"{path}: cannot render it ({type(e).__name__}: {e}); was it written by "
                    f"`{RENDERERS[name][1]}`?") from e


# --- docstrings: a Griffe extension (mkdocs.yml: the python handler's `extensions`) -------------

#: A Sphinx cross-reference role, ``:func:`~convnets.registry.get_model``` and the like.
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|type):`(~?)([^`]+)`")
#: The Google-style sections whose entries name parameters or exceptions.
_NAMED_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|"
                            r"Other Parameters|Raises|Exceptions):\s*$")
_PARAMETER_SECTIONS = ("Args", "Arguments", "Parameters", "Params")
#: An entry's first line: ``name: text``, ``a, b: text`` (several names), ``**kwargs: text``.
_ENTRY = re.compile(r"^(\s+)(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)(\s*(?:\([^)]*\))?\s*:(?:\s.*)?)$")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    if "<" in target and target.endswith(">"):  # :func:`title <target>`
        return f"`{target.split('<')[0].strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


Entry = tuple[str, list[str], str, list[str]]  # indent, names, the first line's rest, continuation lines


def _entries(lines: list[str], start: int, section_indent: int) -> tuple[list[Entry], int]:
    """The entries of the section whose items begin at ``lines[start]``, and the index of the
    first line after the section (its trailing blank lines are not part of it)."""
    entries: list[Entry] = []
    entry_indent = None
    i = start
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > section_indent):
        line = lines[i]
        match = _ENTRY.match(line)
        if entry_indent is None and line.strip():
            entry_indent = _indent(line)
        if match is not None and _indent(line) == entry_indent:
            names = [name.strip() for name in match.group(2).split(",")]
            entries.append((match.group(1), names, match.group(3), []))
        elif entries:
            entries[-1][3].append(line)
        elif line.strip():  # not the Google layout: leave the section alone
            return [], start
        i += 1
    while i > start and not lines[i - 1].strip():
        i -= 1
    for entry in entries:  # blank lines between entries are not part of their text
        while entry[3] and not entry[3][-1].strip():
            entry[3].pop()
    return entries, i


def _rewrite_sections(lines: list[str], keywords_of: Callable[[str], bool] | None) -> list[str]:
    """One entry per name in Args / Raises sections (``a, b: text`` becomes ``a: text`` and
    ``b: text``: Google style, and Griffe checks each documented name against the signature);
    Args entries for which ``keywords_of(name)`` is true move to a ``Keyword Args:`` section."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        heading = _NAMED_SECTION.match(lines[i])
        entries, end = _entries(lines, i + 1, len(heading.group(1))) if heading else ([], i)
        if heading is None or not entries:
            out.append(lines[i])
            i += 1
            continue
        single = [(indent, name, rest, body) for indent, names, rest, body in entries for name in names]
        moved = [e for e in single if keywords_of is not None and heading.group(2) in _PARAMETER_SECTIONS
                 and keywords_of(e[1])]
        kept = [e for e in single if e not in moved]
        for title, group in ((heading.group(2), kept), ("Keyword Args", moved)):
            if group:
                if title == "Keyword Args" and kept:
                    out.append("")
                out.append(f"{heading.group(1)}{title}:")
                out += [line for indent, name, rest, body in group for line in (f"{indent}{name}{rest}", *body)]
        i = end
    return out


def markdown_docstring(text: str, keywords_of: Callable[[str], bool] | None = None) -> str:
    """A docstring written for Sphinx and ``help()``, readable as the Markdown mkdocstrings renders.

    Sphinx roles become inline code; ``Example::`` before a literal block becomes ``Example:`` (the
    indented block stays a code block); grouped entries are split, and Args entries that
    ``keywords_of`` says are keywords taken through ``**kwargs`` move to a ``Keyword Args:``
    section (:func:`_rewrite_sections`). The words themselves are unchanged.
    """
    text = _ROLE.sub(_role, text)
    lines = text.split("\n")
    for i, line in enumerate(lines[:-1]):
        if line.rstrip().endswith("::") and not lines[i + 1].strip():
            stripped = line.rstrip()[:-2]
            lines[i] = stripped + ":" if stripped.strip() else ""
    return "\n".join(_rewrite_sections(lines, keywords_of))


def _runtime_docstring(module: str, name: str) -> str | None:
    """The docstring of ``module.name`` as Python sees it, for objects that the code generates.

    Such a docstring may be assembled from parts indented differently (a builder's is its own
    summary, then the text ``@builder`` adds), so each paragraph is dedented on its own.
    """
    import textwrap

    text = getattr(getattr(_import(module), name, None), "__doc__", None)
    if not text:
        return None
    return "\n\n".join(textwrap.dedent(p).strip("\n") for p in re.split(r"\n[ \t]*\n", text.strip()))


def _completed_at_run_time(node: Any) -> bool:
    """``@builder def ...``: the decorator adds the keywords' documentation to the docstring."""
    import ast

    return any(isinstance(d, ast.Name) and d.id == "builder" for d in getattr(node, "decorator_list", ()))


def _is_stub(node: Any) -> bool:
    """``def f(...) -> T: ...``: a declaration for type checkers of something defined at run time."""
    import ast

    body = getattr(node, "body", None)
    return (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body is not None and len(body) == 1
            and isinstance(body[0], ast.Expr) and getattr(body[0].value, "value", None) is Ellipsis)


try:
    import griffe
except ImportError:  # the tests of the other hooks run without the docs extra
    griffe = None

if griffe is not None:
    class ReadableDocstrings(griffe.Extension):  # type: ignore[misc]
        """Rewrites each docstring with :func:`markdown_docstring` before it is parsed.

        A function stub without a docstring (an ``@overload``) gets the docstring of the object it
        declares, and a model builder the docstring ``@builder`` completes.
        """

        def on_instance(self, *, node: Any, obj: Any, agent: Any, **kwargs: Any) -> None:
            keywords_of = None
            if obj.is_function:
                if (not obj.name.startswith("_")
                        and (obj.docstring is None and _is_stub(node) or _completed_at_run_time(node))):
                    text = _runtime_docstring(obj.module.path, obj.name)
                    if text:
                        obj.docstring = griffe.Docstring(text, lineno=obj.lineno, parent=obj,
                                                         parser=agent.docstring_parser,
                                                         parser_options=agent.docstring_options)
                names = {p.name for p in obj.parameters}
                if any(p.kind is griffe.ParameterKind.var_keyword for p in obj.parameters):
                    def keywords_of(name: str, names: set[str] = names) -> bool:
                        return name.lstrip("*") not in names
            if obj.docstring is not None:
                obj.docstring.value = markdown_docstring(obj.docstring.value, keywords_of)


# --- MkDocs events ------------------------------------------------------------------------------


def render_notebook(path: str) -> str:
    """The cells of the notebook at ``path`` (relative to the repository) as Markdown."""
    file = ROOT / path
    if not file.is_file():
        raise _fail(f"notebook {path} does not exist")
    parts = []
    for cell in json.loads(file.read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"]).strip("\n")
        parts.append(source if cell["cell_type"] == "markdown" else _fence(source, "python"))
    return "\n\n".join(parts) + "\n"


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """Add ``charts/NAME.svg``, drawn now, for each results file that exists and has a chart."""
    from mkdocs.structure.files import File

    for name in charts.CHARTS:
        path = results_dir() / f"{name}.json"
        if path.is_file():
            source = path.relative_to(ROOT).as_posix() if ROOT in path.parents else str(path)
            files.append(File.generated(config, f"{charts.CHART_DIR}/{name}.svg",
                                        content=charts.chart_svg(name, path, source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """Replace the markers of one page's Markdown with their generated Markdown."""
    markdown = _import("docs.pictures").on_page_markdown(markdown)  # the package's own pictures
    markdown = NOTEBOOK_MARKER.sub(lambda m: render_notebook(m.group(1)), markdown)
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if COMMANDS_MARKER in markdown:
        markdown = markdown.replace(COMMANDS_MARKER, cli_commands())
    if cards.MARKER in markdown:
        models = _import("convnets").list_models()
        markdown = markdown.replace(cards.MARKER, "\n".join(
            cards.card(name, ROOT, results_dir(), list(RENDERERS), table) for name in models))
    return RESULTS_MARKER.sub(lambda m: render_results(m.group(1)), markdown)
