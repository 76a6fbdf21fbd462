"""The persistent engine cache (convnets/deploy/cache/), ``convnets cache``, ``--engine``'s default, and
``embed`` through the engines.

Tiny models (conftest.TINY) at 64 px. Each test has its own TORCH_HOME, so its own cache
(conftest.isolated_cache). Conversions are counted by wrapping the formats' conversion functions.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import forked_cli
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY, randomize_bn, run_cli, start_cli
from strict_skips import require_module

import convnets
from convnets.cli import main
from convnets.deploy import cache as engine_cache
from convnets.deploy.formats.openvino import OpenVinoFormat
from convnets.deploy.optimize import optimize_for_inference

SIZE = 64
ENGINES = ("onnxruntime", "openvino")
MODULES = {"onnxruntime": "onnxruntime", "openvino": "openvino"}


# Every test here starts from an empty engine cache of its own.
pytestmark = pytest.mark.usefixtures("cold_engine_cache")


def tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = randomize_bn(convnets.get_model("resnet50", num_classes=10, **TINY["resnet50"]), seed=seed).eval()
    model.input_size = SIZE
    return model


def images(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))


def entries() -> list[Path]:
    root = engine_cache.cache_root()
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


@pytest.mark.parametrize("engine", ENGINES)
def test_a_second_build_loads_the_cached_graph_without_converting(engine: str, conversions: dict[str, int]) -> None:
    require_module(MODULES[engine])
    model, x = tiny(), images()
    first = optimize_for_inference(model, engine=engine)(x)
    assert conversions[engine] == 1 and len(entries()) == 1
    second = optimize_for_inference(model, engine=engine)  # a fresh call: nothing kept in memory
    assert conversions[engine] == 1
    assert engine_cache.entry_of(second) is not None
    torch.testing.assert_close(second(x), first, rtol=0, atol=0)
    # cache=False converts again, and writes nothing
    optimize_for_inference(model, engine=engine, cache=False)
    assert conversions[engine] == 2 and len(entries()) == 1
    # other weights: another entry
    optimize_for_inference(tiny(seed=1), engine=engine)
    assert conversions[engine] == 3 and len(entries()) == 2


_SCRIPT = """
import sys, torch, convnets
sys.path.insert(0, {tests!r})
from conftest import TINY, randomize_bn
from convnets.deploy.formats.onnx import OnnxFormat
calls = []
original = OnnxFormat.write
OnnxFormat.write = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
torch.manual_seed(0)
model = randomize_bn(convnets.get_model("resnet50", num_classes=10, **TINY["resnet50"]), seed=0).eval()
model.input_size = 64
from convnets.deploy.optimize import optimize_for_inference
out = optimize_for_inference(model, engine="onnxruntime")(torch.ones(1, 3, 64, 64))
print(len(calls), float(out.sum()))
"""


def test_a_second_process_loads_and_two_processes_filling_one_entry_both_succeed(tmp_path: Path) -> None:
    require_module("onnxruntime")
    script = _SCRIPT.format(tests=str(REPO / "tests"))
    env = {"CONVNETS_CACHE_DIR": str(tmp_path / "cache")}
    both = [start_cli(code=script, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [tuple(map(forked_cli.text, p.communicate(timeout=600))) + (p.returncode,) for p in both]
    assert all(rc == 0 for _, _, rc in results), [err for _, err, _ in results]
    sums = {out.split()[1] for out, _, _ in results}
    assert len(sums) == 1
    made = [p for p in (tmp_path / "cache").iterdir()]
    assert len(made) == 1 and not made[0].name.startswith("."), made  # one entry, no temporary left
    again = run_cli(code=script, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert again.stdout.split() == ["0", sums.pop()]  # loaded, not converted


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_entry_is_rebuilt_with_the_same_logits(damage: str, conversions: dict[str, int],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    engine = "openvino" if damage == "flip" else "onnxruntime"
    require_module(MODULES[engine])
    model, x = tiny(), images()
    first = optimize_for_inference(model, engine=engine)(x)
    (entry,) = entries()
    victim = entry / ("model.bin" if engine == "openvino" else "model.onnx")
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        middle = len(data) // 2
        victim.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    elif damage == "delete":
        victim.unlink()
    else:
        (entry / "entry.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="convnets.deploy.cache"):
        again = optimize_for_inference(model, engine=engine)(x)
    warnings = [r.getMessage() for r in caplog.records if "rebuilding" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert conversions[engine] == 2
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-5)
    (rebuilt,) = entries()
    assert engine_cache.damage(rebuilt, json.loads((rebuilt / "entry.json").read_text())["key"],
                                 ("model.bin", "model.xml") if engine == "openvino" else ("model.onnx",)) is None


def test_a_version_change_misses_the_cache(conversions: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("onnxruntime")
    model = tiny()
    optimize_for_inference(model, engine="onnxruntime")
    monkeypatch.setattr(convnets, "__version__", "999.0")
    optimize_for_inference(model, engine="onnxruntime")
    assert conversions["onnxruntime"] == 2 and len(entries()) == 2
    monkeypatch.setattr(engine_cache.keys, "versions", lambda runtimes: {"convnets": "999.0", "onnxruntime": "0.0"})
    optimize_for_inference(model, engine="onnxruntime")
    assert conversions["onnxruntime"] == 3


def test_the_umask_is_honoured() -> None:
    require_module("onnxruntime")
    old = os.umask(0o077)
    try:
        optimize_for_inference(tiny(), engine="onnxruntime")
    finally:
        os.umask(old)
    (entry,) = entries()
    assert entry.stat().st_mode & 0o777 == 0o700
    for f in entry.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600, f


def test_auto_records_its_check_and_skips_it_next_time(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    require_module("openvino")
    import convnets.deploy.export as export

    checks = []
    original = export.verify_runner
    monkeypatch.setattr(export, "verify_runner", lambda *a, **k: checks.append(1) or original(*a, **k))
    model = tiny()
    first = optimize_for_inference(model, engine="auto")
    assert first.engine == "openvino" and len(checks) == 1
    caplog.clear()  # an in-process cli.main of an earlier test may have left convnets.auto at INFO
    with caplog.at_level(logging.INFO, logger="convnets.auto"):
        second = optimize_for_inference(model, engine="auto")
    assert second.engine == "openvino" and len(checks) == 1
    picked = [r.getMessage() for r in caplog.records if "picked" in r.getMessage()]
    assert len(picked) == 1 and "engine cache" in picked[0]


def test_auto_skips_an_engine_whose_recorded_check_failed_without_loading_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    require_module("openvino")
    require_module("onnxruntime")
    model = tiny()
    first = optimize_for_inference(model, engine="auto")
    assert first.engine == "openvino"
    entry = engine_cache.entry_of(first)
    assert entry is not None and entry.verdict() is not None and entry.verdict()["passed"] is True
    entry.record_verdict({**entry.verdict(), "passed": False})  # as if OpenVINO had disagreed with the model
    compiles = []
    original = OpenVinoFormat.compile
    monkeypatch.setattr(OpenVinoFormat, "compile", lambda *a, **k: compiles.append(1) or original(*a, **k))
    with caplog.at_level(logging.INFO, logger="convnets"):
        second = optimize_for_inference(model, engine="auto")
    assert second.engine != "openvino" and compiles == []
    assert any("skipping openvino" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    x = images()
    torch.testing.assert_close(second(x), model(x), rtol=1e-4, atol=1e-4)


def test_cache_list_and_clear_delete_only_cache_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    require_module("onnxruntime")
    root = tmp_path / "cache"
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(root))
    optimize_for_inference(tiny(), engine="onnxruntime")
    foreign = root / "notes.txt"
    foreign.write_text("mine")
    (root / "onnxruntime-not-an-entry").mkdir()
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime  fp32  3x64x64" in out and "1 entry" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 engine cache entry" in capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "onnxruntime-not-an-entry"]
    assert main(["cache", "list"]) == 0 and "0 entries" in capsys.readouterr().out


@pytest.mark.parametrize("engine", [*ENGINES, "auto"])
def test_embed_through_each_engine_agrees_with_the_torch_path(engine: str) -> None:
    if engine != "auto":
        require_module(MODULES[engine])
    from convnets.inference.embed import features_model

    model, x = tiny(), images(4)
    expected = features_model(model, "layer4")(x)
    net = features_model(model, "layer4", engine=engine)
    got = net(x)
    assert net.num_features == expected.shape[1] and got.shape == expected.shape
    assert float(F.cosine_similarity(got.double(), expected.double(), dim=1).min()) >= 0.9999
    if engine != "auto":
        assert net.engine == engine


@pytest.mark.parametrize("command", ["predict", "embed", "evaluate", "benchmark"])
def test_engine_defaults_to_auto_and_cache_is_on(command: str) -> None:
    from convnets.cli import build_parser

    parser = build_parser([command])
    extra = {"predict": ["x.jpg"], "embed": ["x.jpg", "--output", "o.npy"], "evaluate": ["--data", "d"]}.get(command, [])
    args = parser.parse_args([command, *extra])
    assert args.engine == "auto" and args.cache is True
    assert parser.parse_args([command, *extra, "--no-cache", "--engine", "torch"]).cache is False
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    help_text = sub.choices[command].format_help()  # type: ignore[attr-defined]
    assert "(default: auto" in " ".join(help_text.split())
