"""The documentation site: its generated parts follow the code and the measurements, and it builds.

* The CLI reference (``docs/cli.md``'s ``<!-- cli-reference -->``) is each parser's own
  ``format_help()``, so a new option is on the site without editing a page.
* Each benchmark table (``<!-- results: NAME -->``) shows the numbers of its results file; a
  file not written yet gives a "Not measured yet" note; a malformed one fails the build.
* ``mkdocs build --strict`` succeeds: no broken link or anchor, no docstring that disagrees with
  its signature (the docs extra; under CI a missing MkDocs fails instead of skipping).

Results files here are written in ``tmp_path``, never in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO


def _load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convnets_docs_hooks", REPO / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


def _expected_help(parser: argparse.ArgumentParser, monkeypatch: pytest.MonkeyPatch) -> str:
    with monkeypatch.context() as m:
        m.setenv("COLUMNS", str(hooks.HELP_COLUMNS))
        m.setenv("NO_COLOR", "1")
        m.delenv("FORCE_COLOR", raising=False)
        return parser.format_help()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return dict(sub.choices)  # type: ignore[arg-type]


def _cli_page() -> str:
    return hooks.on_page_markdown("# CLI reference\n\nIntro.\n\n<!-- cli-reference -->\n", page=None, config=None,
                                  files=None)


# --- the CLI reference ---------------------------------------------------------------------------


def test_cli_reference_is_every_parsers_help(monkeypatch: pytest.MonkeyPatch) -> None:
    from convnets.cli import COMMANDS, build_parser

    page = _cli_page()
    assert "<!-- cli-reference -->" not in page and page.startswith("# CLI reference\n\nIntro.\n")
    parser = build_parser()
    expected = {"convnets": _expected_help(parser, monkeypatch)}
    expected |= {f"convnets {name}": _expected_help(p, monkeypatch) for name, p in _subparsers(parser).items()}
    assert set(expected) == {"convnets", *(f"convnets {name}" for name in COMMANDS)}
    for title, text in expected.items():
        assert f"## `{title}`\n\n```text\n{text.rstrip()}\n```\n" in page, title
    # In the order of `convnets --help`.
    positions = [page.index(f"## `{title}`\n") for title in expected]
    assert positions == sorted(positions)


def test_a_new_option_appears_without_editing_the_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    import convnets.commands.plot as plot

    original = plot.add_arguments

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        original(parser)
        parser.add_argument("--brand-new-option", metavar="VALUE", help="an option no page mentions")

    monkeypatch.setattr(plot, "add_arguments", add_arguments)
    page = _cli_page()
    section = page[page.index("## `convnets plot`"):]
    assert "--brand-new-option VALUE" in section and "an option no page mentions" in section


def test_the_command_table_lists_every_command_with_its_help_and_link() -> None:
    from convnets.cli import COMMANDS, build_parser

    page = hooks.on_page_markdown("## The command line\n\n<!-- cli-commands -->\n", page=None, config=None, files=None)
    rows = [line for line in page.splitlines() if line.startswith("| [")]
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {a.dest: a.help for a in sub._choices_actions}
    assert set(helps) == set(COMMANDS) and len(rows) == len(COMMANDS)
    for name, row in zip(COMMANDS, rows):  # in the order of `convnets --help`
        assert row == f"| [`convnets {name}`](cli.md#convnets-{name}) | {helps[name]} |"
    assert "<!-- cli-commands -->" in (REPO / "docs" / "index.md").read_text(encoding="utf-8")


def test_cli_help_is_wrapped_at_a_fixed_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    narrow_terminal = _cli_page()
    monkeypatch.setenv("COLUMNS", "250")
    assert _cli_page() == narrow_terminal
    assert os.environ["COLUMNS"] == "250"  # restored after the build
    # argparse wraps at the width less 2 (descriptions under RawDescriptionHelpFormatter keep their lines).
    top = narrow_terminal[narrow_terminal.index("## `convnets`"):narrow_terminal.index("## `convnets predict`")]
    assert hooks.HELP_COLUMNS - 10 < max(map(len, top.splitlines())) <= hooks.HELP_COLUMNS - 2


# --- the benchmark tables ------------------------------------------------------------------------

MACHINE = {"torch": "2.14.1+cu130", "python": "3.11.7", "platform": "Linux-x86_64", "device": "cpu",
           "device_name": "AMD EPYC 9R14", "cpu_model": "AMD EPYC 9R14", "cpu_count": 2, "torch_threads": 2,
           "cuda": "13.0", "cudnn": 92400, "mkldnn_bf16": True, "date": "2026-11-26 02:57:22 UTC"}


def _interleaved_row(model: str, batch: int, variant: str, img_per_s: float, speedup: float,
                     lo: float, hi: float, warmup_s: float) -> dict[str, Any]:
    """A row as benchmarks/interleave.py's ``interleaved_rows`` makes it."""
    return {"model": model, "batch_size": batch, "variant": variant, "img_per_s": img_per_s,
            "img_per_s_all_rounds": [img_per_s * 0.97, img_per_s, img_per_s * 1.02], "speedup_vs_timm": speedup,
            "speedup_min_max": [lo, hi], "warmup_s": warmup_s, "compiled": variant.startswith("torch")}


ENGINES = {"mode": "engines", "models": ["resnext101_32x4d"], "batch_sizes": ["1", "16"], "image_size": 224,
           "rounds": 5, "warmup": 2, "calls": 1, "settle_s": 0.5, "timm": "1.0.22", "load_average": [1.25, 2.3],
           "rows": [_interleaved_row("resnext101_32x4d", 16, "timm fp32", 21.37, 1.0, 1.0, 1.0, 2.4),
                    _interleaved_row("resnext101_32x4d", 16, "openvino bf16", 63.81, 2.986, 2.71, 3.12, 11.7)],
           "auto_verdicts": ["resnext101_32x4d b16 bf16: auto picks openvino, fastest measured openvino (same)"],
           "ratio_verdicts": []}

TRAIN_ROW = {"model": "resnext101_32x4d", "device": "cpu", "batch_size": 32, "image_size": 128, "steps": 8,
             "step_ms": [411.0, 412.5], "mean_ms": 411.75}

def _decode_row(name: str, variant: str, img_per_s: float, ratio: float, lo: float, hi: float) -> dict[str, Any]:
    return {"set": name, "image_mb": 3.4, "variant": variant, "img_per_s": img_per_s, "all_rounds": [img_per_s] * 3,
            "vs_model_only": ratio, "vs_model_only_min_max": [lo, hi]}


DECODE = {"model": "se_resnext101_32x4d", "precision": "fp16", "compile": True, "device": "cuda", "batch_size": 64,
          "workers": 15, "rounds": 3, "quick": False, "crop_size": 224, "warmup_s": 12.5,
          "sizes": {"12mp": [4032, 3024], "imagenet": [500, 375]}, "images": {"12mp": 128, "imagenet": 1024},
          "rows": [_decode_row("12mp", "model only", 111.8, 1.0, 1.0, 1.0),
                   _decode_row("12mp", "predict --decode device", 61.5, 0.55, 0.52, 0.58)],
          "verdicts": {"12mp": {"target": 0.5, "device_vs_model_only": 0.55, "cpu_vs_model_only": 0.05, "met": True},
                       "imagenet": {"target": 0.8, "device_vs_model_only": 0.62, "cpu_vs_model_only": 0.4,
                                    "met": False}},
          "agreement": {"12mp": {"images": 32, "top1_agreement": 0.96875, "min_cosine": 0.998123, "mean_cosine": 0.9995,
                                 "max_abs_diff": 0.1051, "mean_abs_diff": 0.00312}},
          "seconds": 181.0}  # invented numbers: the shape bench_decode.py saves

#: Per results name: what its script's ``results.save`` writes as ``results`` (shape and keys as the
#: script writes them; test_samples_have_the_keys_each_script_saves checks the keys), and lines the
#: rendered Markdown must contain, numbers formatted as the script prints them.
SAMPLES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "bench_first_prediction": (
        {"model": "se_resnext101_32x4d", "image": "640x480 JPEG", "rounds": 2, "target_ratio": 1.2,
         "warm_auto_ratio": 1.1537,
         "rows": [{"variant": "torch", "seconds_all_rounds": [3.4443, 3.2228], "median_s": 3.33355,
                   "ratio_to_torch_all_rounds": [1.0, 1.0]},
                  {"variant": "auto warm", "seconds_all_rounds": [3.9873, 3.7161], "median_s": 3.8517,
                   "ratio_to_torch_all_rounds": [1.1576, 1.1531]}]},
        ["| torch | 3.33 | 3.22 | 3.44 | 1.00x | 1.00-1.00 |", "| auto warm | 3.85 | 3.72 | 3.99 | 1.16x | 1.15-1.16 |",
         "1.15x (target at most 1.2x: met)"]),
    "bench_fast_decode": (
        {"images": 24, "image_mb": 3.41, "model": "se_resnext101_32x4d", "precision": "bf16", "batch_size": 8,
         "device": "cpu", "compile": True, "workers": 1, "rounds": 3,
         "pixels": [{"variant": "draft 2x (--fast-decode)", "mean_abs_diff": 0.00731, "max_abs_diff": 0.412,
                     "ms_per_image": 61.2, "ms_all_rounds": [60.4, 61.2, 66.9], "cpu_ms_per_image": 59.8,
                     "cpu_ms_all_rounds": [59.1, 59.8, 60.0]}],
         "model_cpu_ms": [301.0, 299.5, 300.2],
         "end_to_end": {"exact": [2.11, 2.05, 2.17], "fast": [2.96, 3.01, 2.88], "model only": [3.3, 3.31, 3.29]},
         "speedup": [1.403, 1.468, 1.327], "speedup_median": 1.403},
        ["| draft 2x (--fast-decode) | 0.0073 | 0.412 | 61 | 60-67 | 60 |", "| exact | 2.11 | 2.11, 2.05, 2.17 |",
         "| fast | 2.96 | 2.96, 3.01, 2.88 |", "Speed-up fast / exact: 1.40x (1.33-1.47)."]),
    "bench_fast_decode_cuda": (
        {"images": 96, "image_mb": 3.41, "model": "se_resnext101_32x4d", "precision": "bf16", "batch_size": 8,
         "device": "cuda", "compile": False, "workers": 4, "rounds": 3, "pixels": [], "model_cpu_ms": [],
         "end_to_end": {"exact": [41.2, 40.8, 41.9], "fast": [98.1, 97.5, 99.0],
                        "model only": [2100.0, 2080.5, 2110.2]},
         "speedup": [2.381, 2.39, 2.363], "speedup_median": 2.381},
        ["| exact | 41.20 | 41.20, 40.80, 41.90 |", "| fast | 98.10 | 98.10, 97.50, 99.00 |",
         "Speed-up fast / exact: 2.38x (2.36-2.39)."]),
    "bench_decode": (DECODE, ["| 12mp | predict --decode device | 61.5 | 0.55x | 0.52-0.58 |",
                              "12mp: 0.55x model only (target 0.5: met)", "imagenet: 0.62x model only (target 0.8: not met)",
                              "| 12mp | 32 | 96.9 % | 0.99812 | 0.105 | 0.0031 |"]),
    "bench_decode_cuda": (DECODE, ["se_resnext101_32x4d fp16 compiled, batch 64, 15 workers; 12mp 4032x3024 (128 JPEGs)"]),
    "bench_cli": (
        {"rounds": 7, "reference": "import torch", "target_ratio": 0.5, "slowest_ratio": 0.2712,
         "rows": [{"case": "convnets --help", "median_s": 0.0912, "ratio_to_reference": 0.2712,
                   "seconds_all_rounds": [0.0912, 0.0934]},
                  {"case": "import torch", "median_s": 0.3363, "ratio_to_reference": 1.0,
                   "seconds_all_rounds": [0.3363, 0.341]}]},
        ["| `convnets --help` | 0.091 | 0.27 |", "| `import torch` | 0.336 | 1.00 |", "0.27x `import torch` (meets"]),
    "bench_engines": (
        ENGINES,
        ["resnext101_32x4d, 224 px, timm 1.0.22, median of 5 interleaved rounds (load average before and after: "
         "1.2, 2.3):", "| batch | variant | img/s | vs timm fp32 | rounds | warm-up s |",
         "| 16 | timm fp32 | 21.37 | 1.00x | 1.00-1.00 | 2.4 |", "| 16 | openvino bf16 | 63.81 | 2.99x | 2.71-3.12 | 11.7 |",
         "* resnext101_32x4d b16 bf16: auto picks openvino"]),
    "bench_engines_resnet50": (
        {**copy.deepcopy(ENGINES), "models": ["resnet50"], "batch_sizes": ["16"],
         "rows": [_interleaved_row("resnet50", 16, "timm fp32", 30.5, 1.0, 1.0, 1.0, 1.1),
                  _interleaved_row("resnet50", 16, "auto bf16 (openvino)", 95.2, 3.12, 3.0, 3.3, 4.4)],
         "auto_verdicts": ["resnet50 b16 bf16: auto picks openvino, fastest measured openvino (same)"]},
        ["resnet50, 224 px", "| 16 | auto bf16 (openvino) | 95.20 | 3.12x | 3.00-3.30 | 4.4 |"]),
    "bench_engines_int8": (
        {**copy.deepcopy(ENGINES), "mode": "int8", "auto_verdicts": [],
         "rows": [*ENGINES["rows"], _interleaved_row("resnext101_32x4d", 16, "openvino int8", 102.4, 4.79, 4.5, 5.0, 20.1),
                  _interleaved_row("se_resnext101_32x4d", 16, "timm fp32", 20.0, 1.0, 1.0, 1.0, 2.5)],
         "ratio_verdicts": ["resnext101_32x4d b16: openvino int8 / openvino bf16 = 1.62x (rounds 1.55-1.70)"]},
        ["`resnext101_32x4d`:\n\n| batch | variant | img/s | vs openvino bf16 | rounds | warm-up s |",
         "| 16 | openvino bf16 | 63.81 |  |  | 11.7 |", "| 16 | openvino int8 | 102.40 | 1.62x | 1.55-1.70 | 20.1 |",
         "`se_resnext101_32x4d`:\n\n| batch | variant | img/s | vs openvino bf16 | rounds | warm-up s |"]),
    "bench_engines_settings": (
        {**copy.deepcopy(ENGINES), "mode": "settings", "auto_verdicts": [],
         "rows": [*ENGINES["rows"],
                  _interleaved_row("resnext101_32x4d", 16, "openvino bf16 NUM_STREAMS=2", 31.9, 1.49, 1.4, 1.6, 12.0)],
         "ratio_verdicts": ["resnext101_32x4d b16: openvino bf16 NUM_STREAMS=2 / openvino bf16 = 0.50x (rounds 0.48-0.55)"]},
        ["| batch | variant | img/s | vs defaults | rounds | warm-up s |", "| 16 | timm fp32 | 21.37 |  |  | 2.4 |",
         "| 16 | openvino bf16 `NUM_STREAMS=2` | 31.90 | 0.50x | 0.48-0.55 | 12.0 |"]),
    "bench_inference": (
        {"models": ["resnext101_32x4d"], "batch_sizes": ["16"], "image_size": 224, "device": "cpu", "rounds": 5,
         "warmup": 2, "calls": 1, "timm": "1.0.22", "load_average": [3.0, 4.51],
         "rows": [_interleaved_row("resnext101_32x4d", 16, "optimized bf16", 48.123, 2.254, 2.1, 2.31, 9.0)]},
        ["resnext101_32x4d, timm 1.0.22, 224 px, median of 5 interleaved rounds (load average before and after: "
         "3.0, 4.5):", "| 16 | optimized bf16 | 48.12 | 2.25x | 2.10-2.31 | 9.0 |"]),
    "bench_inference_resnet50": (
        {"models": ["resnet50"], "batch_sizes": ["16"], "image_size": 224, "device": "cpu", "rounds": 3,
         "warmup": 2, "calls": 1, "timm": "1.0.22", "load_average": [3.0, 4.51],
         "rows": [_interleaved_row("resnet50", 16, "eager fp32", 30.2, 1.01, 0.98, 1.03, 1.5)]},
        ["resnet50, timm 1.0.22", "| 16 | eager fp32 | 30.20 | 1.01x | 0.98-1.03 | 1.5 |"]),
    "bench_inference_cuda": (
        {"models": ["se_resnext101_32x4d"], "batch_sizes": ["64"], "image_size": 224, "device": "cuda", "rounds": 5,
         "warmup": 2, "calls": 10, "timm": "1.0.22", "load_average": [0.5, 0.7],
         "rows": [_interleaved_row("se_resnext101_32x4d", 64, "timm fp16", 4012.5, 3.5, 3.4, 3.6, 1.0),
                  _interleaved_row("se_resnext101_32x4d", 64, "optimized fp16", 6123.4, 5.341, 5.2, 5.5, 40.2)]},
        ["| 64 | timm fp16 | 4012.50 | 3.50x | 3.40-3.60 | 1.0 |", "| 64 | optimized fp16 | 6123.40 | 5.34x | 5.20-5.50 | 40.2 |"]),
    "bench_load": (
        {"model": "se_resnext101_32x4d", "file_mib": 187.4, "rounds": 5,
         "rows": [{"variant": "baseline", "seconds_median": 1.2345, "vs_baseline": 1.0, "rss_growth_mib": 372.6,
                   "rss_over_file_size": 1.988, "seconds_all_rounds": [1.2345], "rss_growth_kib_all_rounds": [381542]},
                  {"variant": "convnets", "seconds_median": 0.3121, "vs_baseline": 0.2528, "rss_growth_mib": 201.2,
                   "rss_over_file_size": 1.0737, "seconds_all_rounds": [0.3121],
                   "rss_growth_kib_all_rounds": [206029]}]},
        ["| baseline | 1.234 | 1.00x | 373 MiB | 1.99x |", "| convnets | 0.312 | 0.25x | 201 MiB | 1.07x |",
         "file 187 MiB"]),
    "bench_predict_pipeline": (
        {"model": "se_resnext101_32x4d", "images": 500, "image_kb": 151.3, "batch_size": 16, "rounds": 3,
         "workers": 1, "usable_cores": 2, "compile": False,
         "rows": [{"precision": "bf16", "batch_size": 16, "variant": "model only", "pinned": False,
                   "img_per_s": 9.87, "img_per_s_all_rounds": [9.87], "vs_model_only": 1.0,
                   "vs_model_only_min_max": [1.0, 1.0]},
                  {"precision": "bf16", "batch_size": 16, "variant": "end to end, workers 1", "pinned": True,
                   "img_per_s": 4.41, "img_per_s_all_rounds": [4.41], "vs_model_only": 0.912,
                   "vs_model_only_min_max": [0.88, 0.93]}]},
        ["| bf16 | all 2 | model only | 9.9 | 1.00x | 1.00-1.00 |",
         "| bf16 | model 1 + decoder 1 (pinned) | end to end, workers 1 | 4.4 | 0.91x | 0.88-0.93 |"]),
    "bench_preprocess": (
        {"photos": 32, "size": "3000x2000", "megabytes": 41.27, "long_side": 3000, "usable_cores": 2,
         "load_average": 1.37, "repeat": 3, "workers": None,
         "rows": [{"variant": "upstream loop", "median_s": 4.5678, "best_s": 4.4012, "cpu_s": 4.5,
                   "seconds_all_rounds": [4.5678], "cpu_s_all_rounds": [4.5]},
                  {"variant": "prepare_input_from_uri()", "median_s": 2.3456, "best_s": 2.2987, "cpu_s": 4.61,
                   "seconds_all_rounds": [2.3456], "cpu_s_all_rounds": [4.61]}],
         "speedup_median": 1.947, "speedup_best": 1.915, "max_abs_diff": 0.0, "bitwise_equal": True},
        ["| `upstream loop` | 4.568 | 4.401 | 4.500 |", "| `prepare_input_from_uri()` | 2.346 | 2.299 | 4.610 |",
         "Speed-up (median): 1.95x (best/best 1.92x)"]),
    "bench_serve": (
        {"model": "se_resnext101_32x4d", "engine": "openvino", "precision": "fp32", "requests": 64,
         "image": "500x375 JPEG", "max_batch_size": 16, "queue_delay_ms": 5.0, "rounds": 3, "target_ratio": 0.8,
         "worst_ratio_from_8_clients": 0.912, "load_average": [3.1, 4.2],
         "rows": [{"variant": "in process", "img_per_s": 9.81, "img_per_s_all_rounds": [9.81], "vs_in_process": 1.0,
                   "vs_in_process_min_max": [1.0, 1.0], "p50_ms": None, "p99_ms": None, "mean_batch": None},
                  {"variant": "8 clients", "img_per_s": 8.95, "img_per_s_all_rounds": [8.95], "vs_in_process": 0.912,
                   "vs_in_process_min_max": [0.88, 0.95], "p50_ms": 801.4, "p99_ms": 1210.9, "mean_batch": 6.2}],
         "front": {
             "model": "tiny se_resnext101_32x4d (1/8 width), engine torch", "image": "256x256 JPEG", "requests": 400,
             "rounds": 3, "target_ratio": 0.95, "load_average": [1.5, 2.5], "readiness_clients": 8,
             "readiness_per_s": {"front": 3100.4, "socket": 39000.6},
             "rows": [{"protocol": "HTTP", "clients": 1, "front_per_s": 950.2, "socket_per_s": 1000.4, "ratio": 0.95,
                       "ratio_min_max": [0.9, 0.99], "front_p50_p99_ms": [1.04, 2.01],
                       "socket_p50_p99_ms": [0.91, 1.94], "p99_ratio": 1.036, "front_cpu_vs_triton": 0.041},
                      {"protocol": "gRPC", "clients": 64, "front_per_s": 800.0, "socket_per_s": 1000.0, "ratio": 0.8,
                       "ratio_min_max": [0.7, 0.85], "front_p50_p99_ms": [70.0, 90.0],
                       "socket_p50_p99_ms": [60.0, 80.0], "p99_ratio": 1.125, "front_cpu_vs_triton": 0.12}]}},
        ["| in process | 9.81 | 1.00x | 1.00-1.00 |  |  |", "| 8 clients | 8.95 | 0.91x | 0.88-0.95 | 801 / 1211 | 6.2 |",
         "the median served throughput is at least 0.91x in-process (target 0.8x: met)",
         "| HTTP, 1 | 950 / 1000 | 0.95x | 0.90-0.99 | 2.0 / 1.9 (1.04x) | 4 % |",
         "| gRPC, 64 | 800 / 1000 | 0.80x | 0.70-0.85 | 90.0 / 80.0 (1.12x) | 12 % |",
         "within 5 % (throughput and p99) in 1 of 2 rows", "3100 req/s through the front, 39001 on Triton's socket"]),
    "bench_ray": (
        {"images": 2000, "model": "resnext101_32x4d", "batch_size": 16, "rounds": 1, "image_size": "500x375 JPEG",
         "ratio": 0.873, "target_ratio": 0.8, "same_top5": True, "load_average": [0.4, 2.1],
         "rows": [{"variant": "predict", "img_per_s": 11.52, "seconds": 173.6, "first_record_s": 6.1,
                   "after_first_img_per_s": 11.94, "all_rounds": []},
                  {"variant": "predict --ray local", "img_per_s": 10.06, "seconds": 198.8, "first_record_s": 21.4,
                   "after_first_img_per_s": 11.27, "all_rounds": []}]},
        ["| `predict` | 11.52 | 174 | 6.1 | 11.94 |", "| `predict --ray local` | 10.06 | 199 | 21.4 | 11.27 |",
         "0.87x (target at least 0.8x: met)"]),
    "bench_train": (
        {"arch": "resnext101_32x4d", "tiny_kwargs": {"layers": [1, 1, 1, 1]}, "device": "cpu",
         "device_name": "CPU, 2 threads", "batch_size": 32, "image_size": 128, "steps": 8, "warmup": 3,
         "amp_dtype": "bf16", "threads": 2,
         "rows": [{**TRAIN_ROW, "amp_dtype": None, "memory_format": "nchw", "img_per_s": 77.71, "median_ms": 411.8,
                   "vs_fp32_nchw": 1.0},
                  {**TRAIN_ROW, "amp_dtype": "bf16", "memory_format": "nhwc", "img_per_s": 101.04,
                   "median_ms": 316.7, "vs_fp32_nchw": 1.3002}]},
        ["| fp32 | nchw | 77.7 | 411.8 | 1.00x |", "| bf16 | nhwc | 101.0 | 316.7 | 1.30x |"]),
    "bench_train_cuda": (
        {"arch": "se_resnext101_32x4d", "tiny_kwargs": None, "device": "cuda", "device_name": "NVIDIA H100",
         "batch_size": 128, "image_size": 224, "steps": 30, "warmup": 3, "amp_dtype": "fp16", "threads": 16,
         "rows": [{**TRAIN_ROW, "amp_dtype": "fp16", "memory_format": "nhwc", "img_per_s": 2512.3,
                   "median_ms": 50.9, "vs_fp32_nchw": 2.871}]},
        ["| fp16 | nhwc | 2512.3 | 50.9 | 2.87x |"]),
}


def _write(directory: Path, name: str, results: dict[str, Any], machine: dict[str, Any] = MACHINE) -> Path:
    """A results file as benchmarks/results.py's ``save`` writes it."""
    path = directory / f"{name}.json"
    command = hooks.RENDERERS[name][1] + " --rounds 3"
    path.write_text(json.dumps({"date": machine["date"], "machine": machine, "command": command,
                                "results": results}, indent=2) + "\n")
    return path


def test_every_benchmark_script_has_a_renderer() -> None:
    scripts = {p.stem for p in (REPO / "benchmarks").glob("bench_*.py")}
    assert scripts <= set(hooks.RENDERERS), scripts - set(hooks.RENDERERS)
    assert set(SAMPLES) == set(hooks.RENDERERS)


def _saved_keys(script: Path) -> set[str]:
    """The keys of the ``results`` dict literal that the script passes to ``results.save``."""
    calls = [node for node in ast.walk(ast.parse(script.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "save"
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "results"]
    assert len(calls) == 1 and isinstance(calls[0].args[2], ast.Dict), script
    return {ast.literal_eval(key) for key in calls[0].args[2].keys if key is not None}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_samples_have_the_keys_each_script_saves(name: str) -> None:
    command = hooks.RENDERERS[name][1]
    script = REPO / command.split()[1]
    assert script.is_file(), command
    assert set(SAMPLES[name][0]) == _saved_keys(script)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_table_shows_the_numbers_of_its_results_file(name: str, tmp_path: Path) -> None:
    results, lines = SAMPLES[name]
    _write(tmp_path, name, results)
    markdown = hooks.render_results(name, tmp_path)
    for line in lines:
        assert line in markdown, f"{line!r} not in:\n{markdown}"
    table_rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table_rows) >= 2  # a header and at least one row
    assert markdown.rstrip().endswith(f"`{hooks.RENDERERS[name][1]} --rounds 3`.")
    assert ("Measured 2026-11-26 02:57:22 UTC on AMD EPYC 9R14, 2 cores, 2 threads; torch 2.14.1+cu130;"
            in markdown)


def test_ratios_are_table_columns_not_prose(tmp_path: Path) -> None:
    # Each ratio a verdict line states is in the table, in its own cells; no bullet repeats it.
    for name in ("bench_engines_int8", "bench_engines_settings"):
        results, _ = SAMPLES[name]
        _write(tmp_path, name, results)
        markdown = hooks.render_results(name, tmp_path)
        assert not [line for line in markdown.splitlines() if line.startswith("* ")], markdown
        for line in results["ratio_verdicts"]:
            ratio, rounds = re.search(r"= ([\d.]+x) \(rounds ([\d.-]+)\)", line).groups()  # type: ignore[union-attr]
            assert f"| {ratio} | {rounds} |" in markdown, (line, markdown)
    with pytest.raises(Exception, match="unreadable ratio verdict"):
        _write(tmp_path, "bench_engines_int8", {**SAMPLES["bench_engines_int8"][0], "ratio_verdicts": ["1.5x"]})
        hooks.render_results("bench_engines_int8", tmp_path)


def test_the_provenance_line_names_a_gpu(tmp_path: Path) -> None:
    machine = {**MACHINE, "device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"}
    _write(tmp_path, "bench_train_cuda", SAMPLES["bench_train_cuda"][0], machine)
    markdown = hooks.render_results("bench_train_cuda", tmp_path)
    assert "on NVIDIA H100 80GB HBM3 (host: AMD EPYC 9R14, 2 cores, 2 threads); torch 2.14.1+cu130;" in markdown


def test_a_marker_on_a_page_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "bench_cli", SAMPLES["bench_cli"][0])
    monkeypatch.setenv(hooks.RESULTS_DIR_ENV, str(tmp_path))
    page = hooks.on_page_markdown("# Benchmarks\n\n<!-- results: bench_cli -->\n\nAfter.\n", page=None,
                                  config=None, files=None)
    assert "<!--" not in page and "| `convnets --help` | 0.091 | 0.27 |" in page and page.endswith("After.\n")


def test_the_notebook_page_shows_every_cell_of_the_notebook() -> None:
    hooks = _load_hooks()
    page = (REPO / "docs" / "quickstart.md").read_text()
    rendered = hooks.on_page_markdown(page, page=None, config=None, files=None)
    cells = json.loads((REPO / "examples" / "quickstart.ipynb").read_text())["cells"]
    assert cells and "<!-- notebook:" not in rendered
    position = 0
    for cell in cells:  # each cell's text, in order; code cells as Python blocks
        source = "".join(cell["source"]).strip("\n")
        found = rendered.index(f"```python\n{source}\n```" if cell["cell_type"] == "code" else source, position)
        position = found + len(source)
    with pytest.raises(Exception, match="notebook examples/missing.ipynb does not exist"):
        hooks.render_notebook("examples/missing.ipynb")


def test_a_missing_results_file_is_not_measured_yet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(hooks.RESULTS_DIR_ENV, str(tmp_path))
    with caplog.at_level(logging.INFO):
        page = hooks.on_page_markdown("<!-- results: bench_engines_int8 -->\n", page=None, config=None, files=None)
    assert page.startswith('!!! note "Not measured yet"\n\n    ')
    assert "Not measured yet: run `python benchmarks/bench_engines.py --int8`" in page
    records = [r for r in caplog.records if "bench_engines_int8.json" in r.getMessage()]
    assert records and all(r.levelno == logging.INFO for r in records)  # not a warning: --strict passes


@pytest.mark.parametrize("content", ["{", '{"date": "x", "machine": {}, "command": "c"}', "[]",
                                     json.dumps({"date": "d", "machine": MACHINE, "command": "c",
                                                 "results": {"rows": [{"variant": "torch"}]}})])
def test_a_malformed_results_file_fails_the_build(content: str, tmp_path: Path) -> None:
    (tmp_path / "bench_first_prediction.json").write_text(content)
    with pytest.raises(Exception, match="bench_first_prediction.json: cannot render it"):
        hooks.render_results("bench_first_prediction", tmp_path)


def test_an_unknown_results_name_fails_the_build(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no renderer for 'bench_nothing'"):
        hooks.on_page_markdown("<!-- results: bench_nothing -->", page=None, config=None, files=None)


# --- docstrings as mkdocstrings renders them -----------------------------------------------------


def test_docstrings_are_rewritten_for_the_google_parser() -> None:
    text = ("Summary with :func:`~convnets.registry.get_model` and :class:`convnets.ResNet`.\n\n"
            "Example::\n\n    x = f()\n\n"
            "Args:\n    keys, names: each class's key\n        and name.\n\n    device: where.\n"
            "    **kwargs: the rest.\n\n"
            "Raises:\n    A, B: from loading.\n")
    assert hooks.markdown_docstring(text, lambda name: name.lstrip("*") not in {"keys", "names", "kwargs"}) == (
        "Summary with `get_model` and `convnets.ResNet`.\n\n"
        "Example:\n\n    x = f()\n\n"
        "Args:\n    keys: each class's key\n        and name.\n    names: each class's key\n        and name.\n"
        "    **kwargs: the rest.\n\n"
        "Keyword Args:\n    device: where.\n\n"
        "Raises:\n    A: from loading.\n    B: from loading.\n")


# --- the whole site ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_strictly(built_site: Path) -> None:
    """``mkdocs build --strict`` with the real results (the fixture fails on any warning)."""
    assert hooks.RESULTS_DIR_ENV == "CONVNETS_RESULTS_DIR"  # the variable built_site removes
    site = built_site
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    assert "<!-- cli-reference -->" not in cli and "convnets predict" in cli and "--brand-new" not in cli
    models = (site / "reference" / "models" / "index.html").read_text(encoding="utf-8")
    assert "get_model" in models and "pretrained_from_file" in models  # the builders' generated docstring
    # Nothing is fetched from elsewhere when a page is read: no web fonts.
    assert "fonts.googleapis" not in (site / "index.html").read_text(encoding="utf-8")
