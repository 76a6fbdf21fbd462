"""Inference engines behind optimize_for_inference(engine=...): faithful outputs, auto's choice, errors.

Speed is measured by benchmarks/bench_engines.py, never here. Models are the tiny variants of
conftest.TINY with random BatchNorm statistics, at 64 px (``input_size`` set so that each engine
builds one graph); the torch engine runs uncompiled (compiling is tested in test_optimize.py).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, randomize_bn, run_cli
from strict_skips import require_module

import convnets
from convnets.deploy.engines import AUTO_ORDER, auto_order, available_engines, engine_names, get_engine
from convnets.errors import InvalidArgumentError, MissingDependencyError, UnsupportedPrecisionError
from convnets.runtime import cpu_has_bf16

SIZE = 64
CPU = torch.device("cpu")
ONE_BLOCK = json.dumps(dict(layers=[1], widths=[16], cardinality=4, stem_width=16))


# Every test here starts from an empty engine cache of its own.
pytestmark = pytest.mark.usefixtures("cold_engine_cache")


def tiny(arch: str = "se_resnext101_32x4d", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = randomize_bn(convnets.get_model(arch, num_classes=10, **TINY[arch]), seed=seed).eval()
    model.input_size = SIZE
    return model


def images(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def reference(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def engine_precisions() -> list[object]:
    """(engine, precision) for every registered engine and every precision it runs on the CPU."""
    cases = []
    for name in ("torch", "onnxruntime", "openvino"):
        for precision in get_engine(name).precisions:
            if precision == "fp16":
                continue  # CUDA only: no engine runs it on a CPU
            if precision == "int8":
                continue  # needs calibration data and is judged on a trained model: test_int8.py
            marks = [pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16")] \
                if precision == "bf16" else []
            cases.append(pytest.param(name, precision, marks=marks, id=f"{name}-{precision}"))
    return cases


@pytest.fixture(scope="module")
def se_model() -> torch.nn.Module:
    return tiny()


@pytest.mark.parametrize("engine, precision", engine_precisions())
def test_every_engine_matches_the_unoptimized_model(engine: str, precision: str, se_model: torch.nn.Module) -> None:
    for module in get_engine(engine).requires:
        require_module(module)
    model = se_model
    model.class_names = [f"class {i}" for i in range(10)]
    optimized = convnets.optimize_for_inference(model, precision, engine=engine, compile=False)
    assert optimized.engine == engine
    assert optimized.num_classes == 10 and optimized.class_names == model.class_names
    for n in (1, 3):
        x = images(n, seed=n)
        out, expected = optimized(x), reference(model, x)
        assert out.dtype == torch.float32 and out.shape == (n, 10)
        if precision == "fp32":
            assert float((out - expected).abs().max() / expected.abs().max()) <= 1e-4
        else:
            cosine = F.cosine_similarity(out.double(), expected.double(), dim=1)
            assert bool((cosine >= 0.99).all()), cosine
    # A second call at the same shape gives the same answer (no state kept between calls).
    x = images(3, seed=3)
    torch.testing.assert_close(optimized(x), optimized(x), rtol=0, atol=0)


def test_the_engines_are_registered_and_auto_orders_end_with_torch() -> None:
    assert engine_names()[:3] == ("torch", "onnxruntime", "openvino")
    for (device, precision), order in AUTO_ORDER.items():
        assert set(order) <= set(engine_names())
        assert auto_order(precision, torch.device(device))[-1] == "torch"
    assert auto_order("fp16", torch.device("cuda")) == ("torch",)


def test_auto_picks_the_first_installed_engine_of_its_order(caplog: pytest.LogCaptureFixture,
                                                            se_model: torch.nn.Module) -> None:
    expected = next(n for n in auto_order("fp32", CPU) if n in available_engines("fp32", CPU))
    with caplog.at_level(logging.INFO, logger="convnets.auto"):
        optimized = convnets.optimize_for_inference(se_model, "fp32", engine="auto", compile=False)
    assert optimized.engine == expected
    picks = [r.getMessage() for r in caplog.records if "picked" in r.getMessage()]
    assert picks == [f"engine='auto' picked {expected} for fp32 on cpu"]
    x = images(3)
    assert float((optimized(x) - reference(se_model, x)).abs().max() / reference(se_model, x).abs().max()) <= 1e-4


def test_auto_falls_back_to_torch_when_the_extras_are_missing(monkeypatch: pytest.MonkeyPatch,
                                                              se_model: torch.nn.Module) -> None:
    for module in ("onnxruntime", "onnx", "openvino"):
        monkeypatch.setitem(sys.modules, module, None)  # `import` now raises ImportError
    assert available_engines("fp32", CPU) == ("torch",)
    for precision in ("fp32", *(("bf16",) if cpu_has_bf16() else ())):
        optimized = convnets.optimize_for_inference(se_model, precision, engine="auto", compile=False)
        assert optimized.engine == "torch"
        assert optimized(images(2)).shape == (2, 10)


def test_a_missing_extra_is_named_when_the_engine_is_asked_for(monkeypatch: pytest.MonkeyPatch,
                                                                se_model: torch.nn.Module) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(MissingDependencyError, match=r"pip install -c constraints.txt -e '\.\[openvino\]'"):
        convnets.optimize_for_inference(se_model, engine="openvino")
    with pytest.raises(MissingDependencyError, match=r"pip install -c constraints.txt -e '\.\[export\]'"):
        convnets.optimize_for_inference(se_model, engine="onnxruntime")


def test_auto_never_picks_an_engine_whose_output_is_wrong(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture,
                                                          se_model: torch.nn.Module) -> None:
    installed = [n for n in auto_order("fp32", CPU) if n != "torch" and n in available_engines("fp32", CPU)]
    if not installed:
        pytest.skip("no engine other than torch is installed")
    # Every engine but torch is off by 1%: auto must skip them all and say why.
    for name in installed:
        engine = get_engine(name)
        build = engine.build

        def off_by_one_percent(*args: object, _build=build, **kwargs: object) -> torch.nn.Module:
            built = _build(*args, **kwargs)
            forward = built.forward
            built.forward = lambda x: forward(x) * 1.01
            return built
        monkeypatch.setattr(engine, "build", off_by_one_percent)
    with caplog.at_level(logging.WARNING, logger="convnets.deploy.engines"):
        optimized = convnets.optimize_for_inference(se_model, "fp32", engine="auto", compile=False)
    assert optimized.engine == "torch"
    skipped = [r.getMessage() for r in caplog.records if "disagrees" in r.getMessage()]
    assert [m.split(":")[1].split()[0] for m in skipped] == installed


def test_auto_skips_an_engine_that_fails_to_build(monkeypatch: pytest.MonkeyPatch, se_model: torch.nn.Module) -> None:
    first = auto_order("fp32", CPU)[0]
    if first == "torch" or first not in available_engines("fp32", CPU):
        pytest.skip(f"{first} is not installed")

    def broken(*args: object, **kwargs: object) -> torch.nn.Module:
        raise RuntimeError("simulated converter failure")
    monkeypatch.setattr(get_engine(first), "build", broken)
    assert convnets.optimize_for_inference(se_model, "fp32", engine="auto", compile=False).engine != first


@pytest.mark.parametrize("engine, precision, says", [
    ("onnxruntime", "bf16", "runs fp32"),
    ("onnxruntime", "fp16", "runs fp32"),
    ("openvino", "fp16", "runs fp32, bf16"),
])
def test_a_precision_an_engine_does_not_run_is_a_clear_error(engine: str, precision: str, says: str,
                                                             se_model: torch.nn.Module) -> None:
    with pytest.raises(UnsupportedPrecisionError, match=f"the {engine} engine does not run") as info:
        convnets.optimize_for_inference(se_model, precision, engine=engine)
    assert says in str(info.value) and isinstance(info.value, ValueError)


def test_unknown_engine_and_a_device_the_engine_does_not_run_on(se_model: torch.nn.Module) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown inference engine engine='tensorrt'.*auto"):
        convnets.optimize_for_inference(se_model, engine="tensorrt")
    with pytest.raises(UnsupportedPrecisionError, match="runs on cpu only, not cuda"):
        convnets.optimize_for_inference(se_model, engine="openvino", device="cuda")


@pytest.mark.slow
def test_benchmark_all_engines_prints_one_table_and_marks_autos_pick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_cli("benchmark", "--model", "resnext101_32x4d", "--arch-kwargs", ONE_BLOCK, "--device", "cpu",
                   "--engine", "all", "--no-compile", "--batch-sizes", "1,2", "--warmup", "1", "--iterations", "2",
                   "--image-size", str(SIZE), "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    config = report["config"]
    installed = config["engines"]
    assert installed[0] == "torch" and set(installed) <= set(engine_names())
    assert config["engine"] == "all" and config["auto_picks"] in installed
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "Engine" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        (e + (" (auto)" if e == config["auto_picks"] else ""), b) for e in installed for b in ("1", "2")]
    assert "First call (s)" in proc.stdout and "Latency p99 (ms)" in proc.stdout
    assert [(r["engine"], r["batch_size"]) for r in report["results"]] == [(e, b) for e in installed for b in (1, 2)]
    assert all(r["throughput"] > 0 and r["first_call_s"] > 0 for r in report["results"])


def test_benchmark_engine_refuses_no_optimize(tmp_path: Path) -> None:
    proc = run_cli("benchmark", "--model", "resnet50", "--engine", "openvino", "--no-optimize", cwd=tmp_path)
    assert proc.returncode == 1 and "drop --no-optimize" in proc.stderr and "Traceback" not in proc.stderr
    # Both ways out are named: keep the engine (drop --no-optimize) or keep eager (drop --engine).
    assert "or drop --engine openvino to measure the plain eager model" in proc.stderr


def test_predict_runs_through_the_engine_it_is_given(tmp_path: Path) -> None:
    """``convnets predict --engine`` reaches optimize_for_inference: the same probabilities as torch."""
    require_module("onnxruntime", extra="export")
    model = randomize_bn(convnets.get_model("resnet50", num_classes=10, **TINY["resnet50"])).eval()
    checkpoint = tmp_path / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, checkpoint)
    results = {}
    for engine in ("torch", "onnxruntime"):
        proc = run_cli("predict", "--weights", str(checkpoint), "--engine", engine, "--image-size", "64",
                       "--device", "cpu", "--topk", "3", "--json", "examples/chelsea.png", "examples/rocket.jpg")
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[engine] = json.loads(proc.stdout)
    assert [r["input"] for r in results["torch"]] == [r["input"] for r in results["onnxruntime"]]
    for ours, theirs in zip(results["torch"], results["onnxruntime"], strict=True):
        assert [t["index"] for t in ours["top"]] == [t["index"] for t in theirs["top"]]
        assert [t["probability"] for t in ours["top"]] == pytest.approx([t["probability"] for t in theirs["top"]],
                                                                         abs=1e-5)
    bad = run_cli("predict", "--weights", str(checkpoint), "--engine", "onnxruntime", "--precision", "bf16",
                  "examples/chelsea.png")
    assert bad.returncode == 1 and "onnxruntime" in bad.stderr.strip().splitlines()[-1]


#: Builds OpenVINO engine models, lets them go in the order they were made (not the reverse), then
#: has a Python signal handler run. OpenVINO's CPU plugin (2026.4) installs an alternate signal
#: stack for the thread when it is created and puts back the one it found when it is destroyed; with
#: one ``ov.Core`` per compiled model, lifetimes that do not nest left the thread's alternate stack
#: pointing at an unmapped one, and the next signal handled in Python (SIGCHLD, SIGINT, ...) killed
#: the process with SIGSEGV (found as a crash in torch.compile's compiler subprocess in this suite).
OPENVINO_THEN_A_SIGNAL = """
import gc, os, signal, sys
import torch
import convnets
arch, precision = {arch!r}, {precision!r}
model = convnets.get_model("resnext101_32x4d", num_classes=10, **arch).eval()
model.input_size = 32
x = torch.randn(4, 3, 32, 32)
extra = dict(calibration_data=x) if precision == "int8" else {{}}
first = convnets.optimize_for_inference(model, precision, engine="openvino", **extra)
second = convnets.optimize_for_inference(model, "fp32", engine="openvino")
first(x), second(x)
del first; gc.collect()
del second; gc.collect()
handled = []
signal.signal(signal.SIGUSR1, lambda *_: handled.append(1))
os.kill(os.getpid(), signal.SIGUSR1)
print("handled", len(handled))
"""


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_signals_are_still_handled_after_openvino_models_are_released(precision: str) -> None:
    require_module("openvino", extra="openvino")
    if precision == "int8":
        require_module("nncf", extra="openvino")
    script = OPENVINO_THEN_A_SIGNAL.format(arch=TINY["resnext101_32x4d"], precision=precision)
    done = run_cli(code=script)
    assert done.returncode == 0 and "handled 1" in done.stdout, \
        f"exit status {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
