"""Export: ONNX / TorchScript round trips, the Triton repository, the command line and its errors.

Round trips run the exported files with ONNX Runtime and torch.jit.load at batch sizes 1 and 3 and
compare with the original PyTorch model; Triton's config is parsed back with protobuf into
tritonclient's ModelConfig and compared with what the exported graphs themselves declare.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cli_in_process
from test_optimize import max_rel_error, reference, tiny_model

import convnets
from convnets.cli import main
from convnets.deploy import export as export_mod
from convnets.deploy.export import export_model
from convnets.errors import ExportError, MissingDependencyError

HAVE_ONNX = all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAVE_ONNX, reason="the 'export' extra (onnx, onnxruntime) is not installed")
if HAVE_ONNX:
    import onnx
    import onnxruntime as ort

TINY_ARCH = dict(layers=[1, 1, 1, 1], widths=[16, 32, 64, 128], cardinality=4, se_squeeze=8, stem_width=16)
SIZE = 64  # small images keep the round trips fast; the graphs are fully convolutional


def model_config_pb2() -> ModuleType:
    """tritonclient's ModelConfig protobuf module.

    It lives in ``tritonclient/grpc/``, whose package ``__init__`` needs grpcio; the generated
    module itself only needs protobuf, so load it from its file when grpcio is absent.
    """
    try:
        from tritonclient.grpc import model_config_pb2 as module
        return module
    except (ImportError, RuntimeError):
        pass
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("tritonclient is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "grpc" / "model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location("tritonclient_model_config_pb2", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def verification_batch(n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SE-ResNeXt saved as a plain state dict, as a user would."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    torch.save(tiny_model(seed=5, **TINY_ARCH).state_dict(), path)
    return path


# --- round trips ---------------------------------------------------------------------------------

@needs_onnx
def test_onnx_round_trip_at_batch_1_and_3(tmp_path: Path) -> None:
    model = tiny_model()
    result = export_model(model, tmp_path / "model.onnx", format="onnx", batch=verification_batch(),
                          image_size=SIZE)
    graph = onnx.load(str(result.path)).graph
    assert not [n.op_type for n in graph.node if n.op_type == "BatchNormalization"]
    assert max(o.version for o in onnx.load(str(result.path)).opset_import if o.domain in ("", "ai.onnx")) >= 17
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, SIZE, SIZE)
    for batch in (x[:1], x):
        (out,) = session.run(None, {session.get_inputs()[0].name: batch.numpy()})
        assert out.shape == (len(batch), 10)
        assert max_rel_error(torch.from_numpy(out), reference(model, batch)) < 1e-4
    assert result.verification.passed and result.verification.max_rel_error < 1e-4


def test_torchscript_round_trip_at_batch_1_and_3(tmp_path: Path) -> None:
    model = tiny_model()
    result = export_model(model, tmp_path / "model.pt", format="torchscript", batch=verification_batch(),
                          image_size=SIZE)
    loaded = torch.jit.load(str(result.path))
    x = torch.randn(3, 3, SIZE, SIZE)
    for batch in (x[:1], x):
        with torch.no_grad():
            out = loaded(batch)
        assert out.shape == (len(batch), 10) and out.dtype == torch.float32
        assert max_rel_error(out, reference(model, batch)) < 1e-4


@needs_onnx
def test_fp16_onnx_keeps_float32_io_and_cosine_099(tmp_path: Path) -> None:
    model = tiny_model()
    result = export_model(model, tmp_path / "model.onnx", precision="fp16", batch=verification_batch(),
                          image_size=SIZE)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].type == "tensor(float)" and session.get_outputs()[0].type == "tensor(float)"
    initializers = onnx.load(str(result.path)).graph.initializer
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in initializers)
    x = torch.randn(3, 3, SIZE, SIZE)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    cosine = F.cosine_similarity(torch.from_numpy(out).double(), reference(model, x).double(), dim=1)
    assert bool((cosine >= 0.99).all()), cosine


@needs_onnx
def test_an_export_that_disagrees_with_pytorch_fails_and_leaves_no_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real_exportable = export_mod._exportable

    def off_by_one_percent(model: torch.nn.Module, precision: str) -> torch.nn.Module:
        module = real_exportable(model, precision)
        module.module.fc.weight.data.mul_(1.01)  # what a wrong conversion would do
        return module
    monkeypatch.setattr(export_mod, "_exportable", off_by_one_percent)
    for fmt, name in (("onnx", "model.onnx"), ("torchscript", "model.pt")):
        with pytest.raises(ExportError, match="disagrees"):
            export_model(tiny_model(), tmp_path / name, format=fmt, batch=verification_batch(), image_size=SIZE)
    assert list(tmp_path.iterdir()) == []


@needs_onnx
def test_missing_onnxruntime_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(MissingDependencyError, match=r"pip install -c constraints.txt -e '\.\[export\]'"):
        export_model(tiny_model(), tmp_path / "model.onnx", batch=verification_batch(), image_size=SIZE)
    status = main(["export", "--model", "resnet50", "--random-init", "--arch-kwargs",
                   json.dumps(dict(layers=[1], widths=[8])), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err[-1].startswith("convnets export: error: onnxruntime")
    assert "pip install -c constraints.txt -e '.[export]'" in err[-1]
    assert not list(tmp_path.rglob("*.onnx"))



def test_export_triton_without_tritonclient_names_the_extra_before_exporting(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """config.pbtxt is written with tritonclient's protobuf: without it, --triton stops before the export."""
    monkeypatch.setitem(sys.modules, "tritonclient.grpc.model_config_pb2", None)  # makes its import fail
    status = main(["export", "--model", "resnet50", "--random-init", "--arch-kwargs",
                   json.dumps(dict(layers=[1], widths=[8])), "--format", "torchscript", "--triton",
                   "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err[-1].startswith("convnets export: error: tritonclient.grpc.model_config_pb2")
    assert "pip install -c constraints.txt -e '.[triton]'" in err[-1]
    assert not (tmp_path / "out").exists()

# --- Triton repository through the command line --------------------------------------------------

def parse_config(path: Path) -> object:
    text_format = pytest.importorskip("google.protobuf.text_format")
    pb2 = model_config_pb2()
    return text_format.Parse(path.read_text(), pb2.ModelConfig())


def onnx_signature(path: Path) -> tuple[str, list[int], str, list[int]]:
    """Names and shapes as the ONNX graph declares them (symbolic batch axis -> -1)."""
    graph = onnx.load(str(path)).graph

    def dims(value: object) -> list[int]:
        return [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
    return graph.input[0].name, dims(graph.input[0]), graph.output[0].name, dims(graph.output[0])


@needs_onnx
def test_cli_onnx_triton_repository_from_a_checkpoint(tmp_path: Path, checkpoint: Path) -> None:
    out = tmp_path / "repo"
    proc = cli_in_process("export", "--weights", str(checkpoint), "--format", "onnx", "--triton", "--name", "tiny_se",
                          "--max-batch-size", "32", "--output", str(out), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["verification"]["passed"] is True and report["verification"]["max_rel_error"] < 1e-4
    assert report["verification"]["batch_sizes"][-1] == 1
    model_file = out / "tiny_se" / "1" / "model.onnx"
    assert Path(report["path"]) == model_file and model_file.is_file()
    assert (out / "tiny_se" / "README.md").is_file()

    config = parse_config(out / "tiny_se" / "config.pbtxt")
    in_name, in_dims, out_name, out_dims = onnx_signature(model_file)
    assert config.name == "tiny_se" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 32 and config.HasField("dynamic_batching")
    assert in_dims[0] == -1 and out_dims[0] == -1  # dynamic batch axis, implicit in Triton's dims
    assert [config.input[0].name, list(config.input[0].dims)] == [in_name, in_dims[1:]]
    assert [config.output[0].name, list(config.output[0].dims)] == [out_name, out_dims[1:]]
    assert list(config.input[0].dims) == [3, 224, 224] and list(config.output[0].dims) == [10]
    pb2 = model_config_pb2()
    assert config.input[0].data_type == config.output[0].data_type == pb2.TYPE_FP32

    # The file serves the checkpoint's network: compare with PyTorch on the loaded checkpoint.
    model = convnets.load_model(checkpoint)
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, 224, 224)
    (logits,) = session.run([out_name], {in_name: x.numpy()})
    assert max_rel_error(torch.from_numpy(logits), reference(model, x)) < 1e-4


def test_torchscript_triton_config_matches_the_traced_graph(tmp_path: Path, checkpoint: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "repo"
    status = main(["export", "--weights", str(checkpoint), "--format", "torchscript", "--triton",
                   "--output", str(out), "--image-size", str(SIZE)])
    assert status == 0, capsys.readouterr().err
    (model_dir,) = [p for p in out.iterdir() if p.is_dir()]
    config = parse_config(model_dir / "config.pbtxt")
    assert config.platform == "pytorch_libtorch" and config.name == model_dir.name
    assert config.max_batch_size == 64
    module = torch.jit.load(str(model_dir / "1" / "model.pt"))
    graph_inputs = [i.debugName() for i in module.graph.inputs()][1:]  # first one is `self`
    assert len(graph_inputs) == 1 and graph_inputs[0].split(".")[0] == config.input[0].name == "INPUT__0"
    assert config.output[0].name == "OUTPUT__0"  # libtorch maps outputs by this positional convention
    with torch.no_grad():
        y = module(torch.randn(3, *config.input[0].dims))
    assert list(config.input[0].dims) == [3, SIZE, SIZE]
    assert [3, *config.output[0].dims] == list(y.shape)


# --- command-line errors -------------------------------------------------------------------------

def test_a_bad_weights_file_is_a_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "garbage.pth"
    bad.write_bytes(b"this is not a checkpoint" * 10)
    proc = cli_in_process("export", "--weights", str(bad), "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convnets export: error:") and "garbage.pth" in lines[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out" / "model.onnx").exists()


def test_inconsistent_options_are_one_line_errors(tmp_path: Path, checkpoint: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--weights", str(checkpoint), "--arch-kwargs", '{"layers": [1]}'], "--arch-kwargs"),
        (["--weights", str(checkpoint), "--model", "resnext101_32x4d"], "different architecture"),
        (["--model", "resnet50", "--random-init", "--name", "x"], "--triton"),
        (["--model", "resnet50", "--random-init", "--arch-kwargs", '{"depth": 3}'], "depth"),
        (["--random-init"], "--model is required"),
    ]
    for args, message in cases:
        assert main(["export", *args, "--output", str(tmp_path / "out")]) == 1, args
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("convnets export: error:") and message in err[-1], (args, err)
    assert not (tmp_path / "out").exists()


def test_json_report_describes_the_written_file(tmp_path: Path, checkpoint: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--weights", str(checkpoint), "--format", "torchscript", "--output", str(tmp_path),
                 "--image-size", str(SIZE), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    path = Path(report["path"])
    assert path == tmp_path / "model.pt" and path.is_file()
    assert report["weights"] == str(checkpoint) and report["format"] == "torchscript"
    assert report["input"]["shape"] == [-1, 3, SIZE, SIZE] and report["output"]["shape"] == [-1, 10]
    # Always the real photos shipped in the package (no scikit-image, no synthetic fallback).
    assert report["verification"]["inputs"] == "3 photos: chelsea.png, coffee.png, rocket.jpg"
    assert report["files"] == [str(path)]
    assert np.isfinite(report["verification"]["max_abs_error"])


def test_random_init_batchnorm_statistics_normalise_like_a_trained_network() -> None:
    from convnets.deploy.calibrate import calibrate_batchnorm

    model = convnets.get_model("se_resnext101_32x4d", **TINY_ARCH)  # as --random-init builds it
    calibrate_batchnorm(model, image_size=SIZE)
    assert not model.training
    outputs: dict[str, torch.Tensor] = {}
    # clone: the blocks apply ReLU in place to some BatchNorm outputs
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: outputs.__setitem__(name, out.clone()))
             for name, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    with torch.no_grad():
        model(torch.randn(8, 3, SIZE, SIZE))  # fresh inputs from the same distribution
    for hook in hooks:
        hook.remove()
    assert len(outputs) == 17
    for name, out in outputs.items():  # gamma 1, beta 0: normalised outputs have mean 0, std 1
        mean, std = out.mean(dim=(0, 2, 3)), out.std(dim=(0, 2, 3))
        # (freshly initialised, the channel means of the deeper layers are 4 to 7)
        assert float(mean.abs().mean()) < 0.5 and 0.7 < float(std.median()) < 1.4, (name, mean, std)
