"""The benchmark command and its measuring loop: structure and bookkeeping, never speed.

Speed itself is measured by benchmarks/bench_inference.py; timed assertions would only test how
busy the machine is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from convnets.cli import main
from convnets.deploy.benchmark import benchmark_inference, format_table

ONE_BLOCK = json.dumps(dict(layers=[1], widths=[16], cardinality=4, stem_width=16))


@pytest.mark.slow
def test_benchmark_command_writes_the_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_cli("benchmark", "--model", "resnext101_32x4d", "--arch-kwargs", ONE_BLOCK, "--device", "cpu",
                   "--batch-sizes", "1,3", "--warmup", "1", "--iterations", "4", "--image-size", "64",
                   "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]
    assert "Throughput (img/s)" in proc.stdout and "Latency p99 (ms)" in proc.stdout

    report = json.loads(out.read_text())
    assert set(report) == {"environment", "config", "results"}
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["cpu_count"] == os.cpu_count()
    config = report["config"]
    assert config["precision"] == "fp32" and config["optimize"] is True and config["mode"] == "inference"
    assert config["arch_kwargs"] == json.loads(ONE_BLOCK) and config["weights"] == "random-init"
    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        lat = r["latency_ms"]
        assert r["iterations"] == 4 and r["throughput"] > 0
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"]
        # throughput is images over the summed latencies of the timed calls
        assert r["throughput"] == pytest.approx(r["batch_size"] * 1000 / lat["mean"], rel=1e-6)


@pytest.mark.slow
def test_training_mode_times_the_fine_tuning_step(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    proc = run_cli("benchmark", "--model", "se_resnext101_32x4d", "--mode", "training", "--arch-kwargs", ONE_BLOCK,
                   "--device", "cpu", "--batch-sizes", "2,4", "--warmup", "1", "--iterations", "3",
                   "--image-size", "64", "--memory-format", "channels_last", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    config = report["config"]
    assert config["mode"] == "training" and config["variant"] == "fine-tuning step (fp32), channels_last"
    assert [r["batch_size"] for r in report["results"]] == [2, 4]
    for r in report["results"]:
        assert r["iterations"] == 3 and r["first_call_s"] is None
        assert r["throughput"] == pytest.approx(r["batch_size"] * 1000 / r["latency_ms"]["mean"], rel=1e-6)


def test_training_mode_refuses_weights(tmp_path: Path) -> None:
    (tmp_path / "w.pth").write_bytes(b"")
    proc = run_cli("benchmark", "--mode", "training", "--weights", str(tmp_path / "w.pth"), cwd=tmp_path)
    assert proc.returncode == 1 and "drop --weights" in proc.stderr and "Traceback" not in proc.stderr


def test_eager_bf16_autocast_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no native bf16 support")
    out = tmp_path / "bench.json"
    assert main(["benchmark", "--model", "resnet50", "--arch-kwargs", ONE_BLOCK, "--device", "cpu",
                 "--no-optimize", "--precision", "bf16", "--memory-format", "channels_last", "--batch-sizes", "2",
                 "--warmup", "1", "--iterations", "2", "--image-size", "32", "--json", str(out)]) == 0
    assert "eager autocast, channels_last" in capsys.readouterr().out
    config = json.loads(out.read_text())["config"]
    assert config["optimize"] is False and config["compiled"] is False and config["precision"] == "bf16"


def test_fp16_on_cpu_and_bad_batch_sizes_are_one_line_errors(tmp_path: Path) -> None:
    proc = run_cli("benchmark", "--model", "resnet50", "--device", "cpu", "--precision", "fp16", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("convnets benchmark: error: fp16") and "CUDA" in proc.stderr
    proc = run_cli("benchmark", "--model", "resnet50", "--batch-sizes", "1,zero", cwd=tmp_path)
    assert proc.returncode == 2 and "batch sizes" in proc.stderr  # argparse's usage error


def test_each_batch_size_gets_warmup_then_timed_calls_on_the_right_input() -> None:
    seen: list[tuple[tuple[int, ...], bool, bool]] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(x.shape), x.is_contiguous(memory_format=torch.channels_last),
                     torch.is_inference_mode_enabled()))
        return x.mean((2, 3))

    results = benchmark_inference(model, [2, 5], warmup=3, iterations=4, image_size=16,
                                  memory_format=torch.channels_last)
    assert seen == [((2, 3, 16, 16), True, True)] * 7 + [((5, 3, 16, 16), True, True)] * 7
    assert [(r.batch_size, r.iterations) for r in results] == [(2, 4), (5, 4)]
    table = format_table(results, "title").splitlines()
    assert table[0] == "**title**" and len(table) == 2 + 2 + 2
    assert table[-1].startswith("| 5 |")


def test_warmup_and_iterations_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        benchmark_inference(lambda x: x, [1], warmup=0, iterations=1)
