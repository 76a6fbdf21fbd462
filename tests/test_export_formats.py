"""The export-format registry: a format is one plug-in, the example photos ship in the package.

A test-only format that writes two files (a TorchScript graph and a JSON sidecar) and is served by
a Triton *backend* goes through the same paths as the coming OpenVINO IR format (model.xml +
model.bin, ``backend: "openvino"``): registration, ``--help``, format options, atomic replacement
of every file, the Triton configuration.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LoopbackServer, Route, cli_in_process
from test_export import SIZE, model_config_pb2, parse_config, verification_batch
from test_optimize import max_rel_error, reference, tiny_model
from train_support import make_digits, tiny_args

import convnets.deploy.formats as formats
from convnets.assets import EXAMPLES_DIR, example_images
from convnets.cli import main
from convnets.deploy import export as export_mod
from convnets.deploy.export import export_model, sample_batch
from convnets.preprocessing.presets import EvalPreset
from convnets.deploy.formats import FormatOption, export_formats, get_format, register_format
from convnets.deploy.formats.torchscript import TorchScriptFormat
from convnets.errors import ExportError, InvalidArgumentError, UnknownArgumentError
from processing_utils import prepare_input_from_uri

REPO = Path(__file__).resolve().parents[1]
PHOTOS = ["chelsea.png", "coffee.png", "rocket.jpg"]


class TwoFileFormat(TorchScriptFormat):
    """TorchScript plus a JSON sidecar that the runner needs: a format made of two files."""

    name = "twofile"
    description = "test format: TorchScript + JSON sidecar"
    file_names = ("model.ts", "model.json")
    runtime = "torch.jit.load + sidecar"
    triton_platform = None
    triton_backend = "test_backend"
    options = (FormatOption("scale", float, 1.0, "multiply the logits (a wrong value must fail verification)"),)

    def write(self, module: torch.nn.Module, path: Path, example: torch.Tensor, *, scale: float = 1.0) -> None:
        super().write(module, path, example)
        path.with_suffix(".json").write_text(json.dumps({"scale": scale}))

    def load_runner(self, path: Path):  # noqa: ANN201 - a Runner
        run = super().load_runner(path)
        scale = json.loads(path.with_suffix(".json").read_text())["scale"]  # fails if the sidecar is missing
        return lambda batch: run(batch) * scale


class NoTritonFormat(TorchScriptFormat):
    name = "notriton"
    description = "test format without a Triton backend"
    file_names = ("model.nt",)
    triton_platform = None
    deprecated = "use --format twofile"


@pytest.fixture
def extra_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two test formats registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(formats.FORMATS, "_items", dict(formats.FORMATS._items))
    register_format(TwoFileFormat())
    register_format(NoTritonFormat())


# --- the registry --------------------------------------------------------------------------------

def test_builtin_formats_declare_what_export_and_triton_need() -> None:
    assert [f.name for f in export_formats()] == ["onnx", "openvino", "aoti", "torchscript", "timm"]
    onnx, ts = get_format("onnx"), get_format("torchscript")
    assert (onnx.file_names, onnx.input_name, onnx.output_name, onnx.triton_platform) == (
        ("model.onnx",), "input", "output", "onnxruntime_onnx")
    assert (ts.file_names, ts.input_name, ts.output_name, ts.triton_platform) == (
        ("model.pt",), "INPUT__0", "OUTPUT__0", "pytorch_libtorch")
    assert onnx.requires == ("onnx", "onnxruntime") and onnx.extra == "export" and ts.requires == ()
    assert [o.flag for o in onnx.options] == ["--opset"] and ts.options == ()


def test_registry_import_loads_no_exporter() -> None:
    """``--help`` lists the formats and their options without loading an exporter or runtime.

    (PyTorch itself comes with ``convnets.deploy``'s ``__init__`` today.)
    """
    code = ("import sys, convnets.deploy.formats as f; print([x.name for x in f.export_formats()]); "
            "print(sorted(m for m in ('onnx', 'onnxruntime', 'torch.onnx', 'openvino', 'torch._inductor', 'timm') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["['onnx', 'openvino', 'aoti', 'torchscript', 'timm']", "[]"]


def test_unknown_formats_and_options_are_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError,
                       match=r"unknown export format 'tflite'; choose one of onnx, openvino, aoti, torchscript, timm"):
        get_format("tflite")
    with pytest.raises(InvalidArgumentError, match="tflite"):
        export_model(tiny_model(), tmp_path / "m", format="tflite", batch=verification_batch(), image_size=SIZE)
    with pytest.raises(UnknownArgumentError, match="torchscript export format does not take opset"):
        export_model(tiny_model(), tmp_path / "model.pt", format="torchscript", opset=17,
                     batch=verification_batch(), image_size=SIZE)
    with pytest.raises(InvalidArgumentError, match="opset must be an integer, 17 or newer; got 16"):
        export_model(tiny_model(), tmp_path / "model.onnx", opset=16, batch=verification_batch(), image_size=SIZE)
    with pytest.raises(InvalidArgumentError, match="already registered"):
        register_format(type("Clash", (TorchScriptFormat,), {})())  # a second "torchscript"
    assert list(tmp_path.iterdir()) == []


def test_an_option_of_another_format_is_a_one_line_cli_error(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["export", "--model", "resnet50", "--random-init", "--format", "torchscript", "--opset", "18",
                   "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and err[-1] == "convnets export: error: --opset applies to --format onnx, not torchscript"
    assert not (tmp_path / "out").exists()


# --- a new format is one plug-in -----------------------------------------------------------------

def test_a_registered_format_is_listed_in_help_with_its_options(extra_formats: None,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--format {onnx,openvino,aoti,torchscript,timm,twofile,notriton}" in text
    assert "twofile (test format: TorchScript + JSON sidecar)" in text
    assert "notriton (test format without a Triton backend) [deprecated: use --format twofile]" in text
    assert "--format twofile options: --scale SCALE multiply the logits" in text
    assert "for Triton (formats: onnx, openvino, torchscript, twofile)" in text


def test_a_two_file_format_exports_verifies_and_serves_on_triton(extra_formats: None, tmp_path: Path,
                                                                 checkpoint: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "repo"
    status = main(["export", "--weights", str(checkpoint), "--format", "twofile", "--triton", "--name", "two",
                   "--image-size", str(SIZE), "--output", str(out), "--json"])
    assert status == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    version = out / "two" / "1"
    assert report["files"] == [str(version / "model.ts"), str(version / "model.json")]
    assert sorted(p.name for p in version.iterdir()) == ["model.json", "model.ts"]
    assert report["verification"]["passed"] and report["verification"]["batch_sizes"] == [3, 1]
    config = parse_config(out / "two" / "config.pbtxt")
    assert config.backend == "test_backend" and config.platform == ""
    assert [config.input[0].name, list(config.input[0].dims)] == ["INPUT__0", [3, SIZE, SIZE]]
    assert config.output[0].name == "OUTPUT__0" and list(config.output[0].dims) == [10]
    assert config.input[0].data_type == model_config_pb2().TYPE_FP32
    assert "`two/1/model.ts`, `two/1/model.json` (twofile, fp32)" in (out / "two" / "README.md").read_text()


def test_a_failed_multi_file_export_leaves_no_file_behind(extra_formats: None, tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text("an older export's sidecar")
    with pytest.raises(ExportError, match="exported twofile model disagrees"):  # force: may replace the older one
        export_model(tiny_model(), tmp_path / "model.ts", format="twofile", scale=1.01, batch=verification_batch(),
                     image_size=SIZE, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["model.json"]  # untouched, no temporary folder
    assert (tmp_path / "model.json").read_text() == "an older export's sidecar"
    result = export_model(tiny_model(), tmp_path / "model.ts", format="twofile", batch=verification_batch(),
                          image_size=SIZE, force=True)
    assert result.files == (tmp_path / "model.ts", tmp_path / "model.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.json", "model.ts"]
    x = torch.randn(2, 3, SIZE, SIZE)
    assert max_rel_error(TwoFileFormat().load_runner(result.path)(x), reference(tiny_model(), x)) < 1e-4


def test_triton_refuses_a_format_without_a_backend(extra_formats: None, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["export", "--model", "resnet50", "--random-init", "--format", "notriton", "--triton",
                   "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err[-1] == ("convnets export: error: Triton has no backend for the notriton format; use --format onnx "
                       "or --format openvino or --format torchscript or --format twofile with --triton")
    assert not (tmp_path / "out").exists()


# --- real photos, always -------------------------------------------------------------------------

def test_verification_batch_is_the_packaged_photos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "skimage", None)  # scikit-image plays no part any more
    assert [p.name for p in example_images()] == PHOTOS
    assert EXAMPLES_DIR == REPO / "convnets" / "assets" / "examples"
    for name in PHOTOS:  # the README's `convnets predict examples/`
        assert (REPO / "examples" / name).resolve() == EXAMPLES_DIR / name
    batch, description = sample_batch(image_size=SIZE)
    assert description == "3 photos: chelsea.png, coffee.png, rocket.jpg"
    preset = EvalPreset.for_image_size(SIZE)
    resize, crop = preset.resize_size, preset.crop_size
    assert (resize, crop) == (73, 64) and EvalPreset.for_image_size(224).resize_size == 256
    expected = prepare_input_from_uri([EXAMPLES_DIR / n for n in PHOTOS], image_size=64, resize_size=73)
    assert torch.equal(batch, expected)


def test_verification_photos_can_be_urls(http_server: LoopbackServer) -> None:
    """``--images http://...`` is downloaded (as predict downloads), not taken for a local path."""
    http_server.routes["/photos/rocket.jpg"] = Route((EXAMPLES_DIR / "rocket.jpg").read_bytes(), content_type="image/jpeg")
    url = f"{http_server.base_url}/photos/rocket.jpg"
    batch, description = sample_batch([url, EXAMPLES_DIR / "coffee.png"], image_size=SIZE, timeout=10,
                                      allow_private=True)
    assert description == f"2 photos: {url}, coffee.png"
    expected = prepare_input_from_uri([EXAMPLES_DIR / "rocket.jpg", EXAMPLES_DIR / "coffee.png"], image_size=64,
                                      resize_size=73)
    assert torch.equal(batch, expected) and http_server.hits["/photos/rocket.jpg"] == 1


def test_a_broken_install_without_photos_is_an_export_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export_mod, "example_images", lambda: [])
    with pytest.raises(ExportError, match="--images"):
        sample_batch(image_size=SIZE)


# --- the image size a checkpoint was trained at --------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SE-ResNeXt saved as a plain state dict (it records no image size)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth"
    torch.save(tiny_model(seed=5).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def trained_32px(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint written by ``convnets train`` at 32 px (one epoch on a few real digit scans)."""
    root = tmp_path_factory.mktemp("train")
    make_digits(root / "data", n_train=48, n_val=40, size=32)
    done = cli_in_process("train", *tiny_args(root / "data", root / "out", 1))
    assert done.returncode == 0, done.stderr
    return root / "out" / "checkpoint.pth.tar"


def test_export_uses_the_image_size_the_checkpoint_was_trained_at(trained_32px: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--weights", str(trained_32px), "--format", "torchscript", "--output",
                 str(tmp_path / "a"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["input"]["shape"] == [-1, 3, 32, 32] and report["output"]["shape"] == [-1, 4]
    assert main(["export", "--weights", str(trained_32px), "--format", "torchscript", "--output",
                 str(tmp_path / "b"), "--image-size", "48", "--json"]) == 0  # an explicit size wins
    assert json.loads(capsys.readouterr().out)["input"]["shape"] == [-1, 3, 48, 48]
