"""The AOTInductor and OpenVINO export formats, and TorchScript's deprecation.

Each format is exported once by ``convnets export`` in a real subprocess (tiny networks from
``conftest.TINY``, 64-pixel images; the AOTInductor test takes 15 s with a warm Inductor cache and
26 s cold on a busy 2-core machine, the OpenVINO one 9 s), then loaded in this test with the
format's own loader (``torch._inductor.aoti_load_package``, ``openvino.Core``), independently of
the package's verification, and run at batch 1 and 3 against the PyTorch model. That model is
handed to the command as ``--weights`` (a plain state dict of a tiny architecture) rather than
built by ``--random-init --arch-kwargs``, so that the test holds the very weights it compares with.
The OpenVINO export is written as a Triton model repository, whose ``config.pbtxt`` is parsed back
as tritonclient's ``ModelConfig``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TINY, randomize_bn, run_cli
from strict_skips import require_module
from test_export import model_config_pb2, parse_config, verification_batch
from test_optimize import max_rel_error, reference

import convnets
from convnets.cli import main
from convnets.deploy import export as export_mod
from convnets.deploy.export import export_model
from convnets.deploy.formats import export_formats, get_format
from convnets.errors import ExportError, MissingDependencyError

SIZE = 64


def tiny(arch: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return randomize_bn(convnets.get_model(arch, num_classes=10, **TINY[arch]), seed=seed).eval()


def save(model: torch.nn.Module, folder: Path) -> Path:
    """The model as a plain state dict: ``convnets export --weights`` reads the architecture off it."""
    path = folder / "tiny.pth"
    torch.save(model.state_dict(), path)
    return path


def export(tmp_path: Path, checkpoint: Path, *args: str) -> dict:
    # -O0 for AOTInductor's generated wrapper (the sequence of kernel calls, not the kernels):
    # a few seconds less compiling here; it changes only the wrapper's own speed, not the results.
    proc = run_cli("export", "--weights", str(checkpoint), "--image-size", str(SIZE), "--output",
                   str(tmp_path / "out"), "--json", *args, cwd=tmp_path,
                   env={"AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL": "O0"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verification"]["passed"] and report["verification"]["batch_sizes"] == [3, 1]
    assert report["input"]["shape"] == [-1, 3, SIZE, SIZE] and report["output"]["shape"] == [-1, 10]
    return report


def test_the_new_formats_are_registered() -> None:
    assert [f.name for f in export_formats()] == ["onnx", "openvino", "aoti", "torchscript", "timm"]
    aoti, ov = get_format("aoti"), get_format("openvino")
    assert aoti.file_names == ("model.pt2",) and not aoti.serves_on_triton and aoti.requires == ()
    assert ov.file_names == ("model.xml", "model.bin") and (ov.triton_platform, ov.triton_backend) == (
        None, "openvino")
    assert (ov.extra, ov.requires, ov.triton_instance_kind) == ("openvino", ("openvino",), "KIND_CPU")
    assert get_format("torchscript").deprecated and not aoti.deprecated and not ov.deprecated


# --- AOTInductor ---------------------------------------------------------------------------------

def needs_cpp_compiler() -> None:
    """Skip (also under CI: a compiler is no pip dependency) where AOTInductor has no C++ compiler."""
    try:
        get_format("aoti").check_dependencies()
    except MissingDependencyError:
        pytest.skip("no C++ compiler found (g++ or $CXX): AOTInductor compiles the package with one")


def test_aoti_package_round_trips_at_batch_1_and_3(tmp_path: Path) -> None:
    needs_cpp_compiler()
    model = tiny("resnext101_32x4d", seed=1)
    report = export(tmp_path, save(model, tmp_path), "--format", "aoti")
    package = tmp_path / "out" / "model.pt2"
    assert report["files"] == [str(package)] and sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.pt2"]
    from torch._inductor import aoti_load_package

    runner = aoti_load_package(str(package))  # no convnets code: the package carries the network
    x = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))
    for batch in (x[:1], x):
        out = runner(batch)
        assert out.shape == (len(batch), 10) and out.dtype == torch.float32
        assert max_rel_error(out, reference(model, batch)) < 1e-4


def test_aoti_without_a_cpp_compiler_is_a_clear_error(tmp_path: Path, patch_inductor: Callable[..., None]) -> None:
    patch_inductor({"cpp.cxx": (None, str(tmp_path / "no-such-g++"))})
    with pytest.raises(MissingDependencyError, match=r"no C\+\+ compiler.*set CXX"):
        export_model(tiny("resnet50", seed=0), tmp_path / "model.pt2", format="aoti", batch=verification_batch(),
                     image_size=SIZE)
    assert list(tmp_path.iterdir()) == []


def test_triton_refuses_aoti(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["export", "--model", "resnet50", "--random-init", "--format", "aoti", "--triton",
                   "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and err[-1].startswith("convnets export: error: Triton has no backend for the aoti format")
    assert not (tmp_path / "out").exists()


# --- OpenVINO IR, as a Triton model repository ---------------------------------------------------

def test_openvino_triton_repository_round_trips_at_batch_1_and_3(tmp_path: Path) -> None:
    ov = require_module("openvino", extra="openvino")
    model = tiny("se_resnext101_32x4d", seed=2)
    report = export(tmp_path, save(model, tmp_path), "--format", "openvino", "--triton", "--name", "tiny_ov",
                    "--max-batch-size", "8")
    model_dir = tmp_path / "out" / "tiny_ov"
    xml, weights = model_dir / "1" / "model.xml", model_dir / "1" / "model.bin"
    assert report["files"] == [str(xml), str(weights)]
    assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["model.bin", "model.xml"]
    assert 'element_type="f16"' not in xml.read_text()  # fp32 weights: save_model's fp16 compression is off

    core = ov.Core()
    ir = core.read_model(str(xml))  # finds model.bin next to it
    (ir_input,), (ir_output,) = ir.inputs, ir.outputs
    assert ir_input.get_partial_shape().is_dynamic and ir_input.get_partial_shape()[0].is_dynamic
    assert [d.get_length() for d in list(ir_input.get_partial_shape())[1:]] == [3, SIZE, SIZE]

    config = parse_config(model_dir / "config.pbtxt")
    pb2 = model_config_pb2()
    assert (config.name, config.backend, config.platform, config.max_batch_size) == ("tiny_ov", "openvino", "", 8)
    assert [config.input[0].name, list(config.input[0].dims)] == [ir_input.get_any_name(), [3, SIZE, SIZE]]
    assert [config.output[0].name, list(config.output[0].dims)] == [ir_output.get_any_name(), [10]]
    assert config.input[0].data_type == config.output[0].data_type == pb2.TYPE_FP32
    assert [g.kind for g in config.instance_group] == [pb2.ModelInstanceGroup.KIND_CPU]
    assert config.HasField("dynamic_batching")
    readme = (model_dir / "README.md").read_text()
    assert "`tiny_ov/1/model.xml`, `tiny_ov/1/model.bin` (openvino, fp32)" in readme and "KIND_CPU" in readme

    # f32 explicitly: OpenVINO's CPU default here is bf16, which is not what the IR holds.
    compiled = core.compile_model(ir, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    x = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(8))
    for batch in (x[:1], x):
        out = compiled(batch.numpy())[0]
        assert out.shape == (len(batch), 10)
        assert max_rel_error(torch.from_numpy(out), reference(model, batch)) < 1e-4


def test_an_openvino_export_that_disagrees_leaves_neither_file(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("openvino", extra="openvino")
    real_exportable = export_mod._exportable

    def off_by_one_percent(model: torch.nn.Module, precision: str) -> torch.nn.Module:
        module = real_exportable(model, precision)
        module.module.fc.weight.data.mul_(1.01)  # what a wrong conversion would do
        return module
    monkeypatch.setattr(export_mod, "_exportable", off_by_one_percent)
    with pytest.raises(ExportError, match="exported openvino model disagrees"):
        export_model(tiny("resnet50", seed=0), tmp_path / "model.xml", format="openvino",
                     batch=verification_batch(), image_size=SIZE)
    assert list(tmp_path.iterdir()) == []


def test_missing_openvino_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openvino", None)  # makes `import openvino` fail
    with pytest.raises(MissingDependencyError, match=r"pip install -c constraints.txt -e '\.\[openvino\]'"):
        export_model(tiny("resnet50", seed=0), tmp_path / "model.xml", format="openvino",
                     batch=verification_batch(), image_size=SIZE)
    assert list(tmp_path.iterdir()) == []


# --- TorchScript: deprecated, replacement named --------------------------------------------------

def test_torchscript_is_marked_deprecated_in_help_and_on_export(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--format {onnx,openvino,aoti,torchscript,timm}" in text
    assert ("[deprecated: PyTorch is retiring torch.jit; use --format aoti for deployment without Python, "
            "--format onnx or --format openvino for Triton]") in text
    with caplog.at_level(logging.WARNING, logger="convnets.deploy.export"):
        export_model(tiny("resnet50", seed=0), tmp_path / "model.pt", format="torchscript",
                     batch=verification_batch(), image_size=SIZE)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "torchscript export format is deprecated" in warning.getMessage()
    assert "--format aoti" in warning.getMessage()
