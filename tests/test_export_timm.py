"""``--format timm``: a folder that timm itself loads into the same classifier, offline.

timm is the judge: a separate process (forked from an interpreter that has imported PyTorch and
nothing else: tests/forked_cli.py), with ``HF_HUB_OFFLINE=1`` and every socket connection
refused, builds the model from the exported folder (``local-dir:`` and the ``file`` overlay) and
its logits are compared with ours. The expected config values are literals from the sources
(NVIDIA's evaluation: resize 256, crop 224, bilinear, ImageNet mean and std; WordNet synsets).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, randomize_bn, run_cli
from strict_skips import require_module

import convnets
from convnets.cli import main
from convnets.deploy.export import export_model
from convnets.errors import ExportError
from convnets.weights.safetensors_io import save_safetensors

pytestmark = pytest.mark.usefixtures("offline_hub")

#: Loads the folder with timm in a separate process that cannot reach any network, runs the batch;
#: also through our model, loaded in that same interpreter, so that both run with the same threads and
#: kernels (the test's worker process may differ: oneDNN's results depend on them, not on the model).
TIMM_LOAD = r"""
import json, os, socket, sys
import torch

def refuse(*args, **kwargs):
    raise OSError("network use in an offline test")

socket.socket.connect = refuse
import timm

folder, arch, batch_file, out_file, ours_file = sys.argv[1:]
x = torch.load(batch_file)
import convnets
ours = convnets.load_model(ours_file).eval()
with open(os.path.join(folder, "config.json")) as f:
    num_classes = json.load(f)["num_classes"]  # the overlay names the weights file only
overlay = timm.create_model(arch, pretrained=True, num_classes=num_classes,
                            pretrained_cfg_overlay=dict(file=os.path.join(folder, "model.safetensors"))).eval()
local = timm.create_model("local-dir:" + folder, pretrained=True).eval()
with torch.no_grad():
    torch.save({"overlay": overlay(x), "local_dir": local(x), "cfg": dict(local.pretrained_cfg), "ours": ours(x)},
               out_file)
"""


@pytest.fixture
def offline_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """timm in this process (export verification) must not reach the Hugging Face Hub either."""
    require_module("timm")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _timm_logits(folder: Path, arch: str, x: torch.Tensor, tmp_path: Path, model: torch.nn.Module) -> dict:
    """timm's logits for ``x`` from the exported ``folder``, and ``model``'s in the same interpreter
    (``"ours"``, checked here against ``model`` run in this process)."""
    batch, out = tmp_path / "batch.pt", tmp_path / "timm_out.pt"
    torch.save(x, batch)
    ours = save_safetensors(model, tmp_path / "ours.safetensors", image_size=x.shape[-1])
    done = run_cli(str(folder), arch, str(batch), str(out), str(ours), code=TIMM_LOAD, env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    logits = torch.load(out, weights_only=False)
    with torch.no_grad():  # the same model: float32 rounding apart (another process's kernels)
        here = model.eval()(x)
    torch.testing.assert_close(logits["ours"], here, rtol=1e-4, atol=1e-5 * here.abs().max().item())
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "resnext101_32x4d"])
def test_timm_builds_the_same_classifier_from_the_export(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(name)).eval()
    folder = tmp_path / "export"
    folder.mkdir()
    result = export_model(model, folder / "model.safetensors", format="timm", image_size=64)
    assert result.verification.passed and result.files == (folder / "model.safetensors", folder / "config.json")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    x = torch.randn(2, 3, 64, 64)
    theirs = _timm_logits(folder, name, x, tmp_path, model)
    torch.testing.assert_close(theirs["overlay"], theirs["ours"])  # identical, in one interpreter
    torch.testing.assert_close(theirs["local_dir"], theirs["ours"])
    cfg = theirs["cfg"]
    assert (cfg["architecture"], cfg["num_classes"], cfg["label_names"][0]) == (name, 1000, "n01440764")


def test_the_command_writes_timms_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "resnet50.nvidia"
    assert main(["export", "--model", "resnet50", "--random-init", "--format", "timm", "--output", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "timm" and report["verification"]["passed"]
    assert report["files"] == [str(out / "model.safetensors"), str(out / "config.json")]
    config = json.loads((out / "config.json").read_text())
    assert (config["architecture"], config["num_classes"], config["num_features"]) == ("resnet50", 1000, 2048)
    assert len(config["label_names"]) == 1000 and config["label_names"][:2] == ["n01440764", "n01443537"]
    assert config["label_descriptions"]["n01440764"].startswith("tench")
    cfg = config["pretrained_cfg"]
    assert (cfg["input_size"], cfg["crop_pct"], cfg["interpolation"], cfg["crop_mode"]) == (
        [3, 224, 224], 0.875, "bilinear", "center")
    assert (cfg["mean"], cfg["std"]) == ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    # convnets reads its own export back too (the architecture is recorded in the safetensors header).
    assert convnets.load_model(out / "model.safetensors").spec == convnets.models.MODEL_SPECS["resnet50"]


@pytest.mark.slow
def test_a_fine_tuned_head_keeps_its_class_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = convnets.resnet50(num_classes=3)
    model.class_names = ["cat", "dog", "rocket"]
    checkpoint = save_safetensors(randomize_bn(model), tmp_path / "fine_tuned.safetensors", image_size=64)
    out = tmp_path / "out"
    assert main(["export", "--weights", str(checkpoint), "--format", "timm", "--output", str(out)]) == 0
    assert "verified with timm" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert (config["num_classes"], config["label_names"], config["pretrained_cfg"]["input_size"]) == (
        3, ["cat", "dog", "rocket"], [3, 64, 64])
    assert "label_descriptions" not in config
    x = torch.randn(1, 3, 64, 64)
    theirs = _timm_logits(out, "resnet50", x, tmp_path, model)
    torch.testing.assert_close(theirs["local_dir"], theirs["ours"])
    assert theirs["cfg"]["label_names"] == ["cat", "dog", "rocket"]


def test_se_resnext_is_not_representable_and_the_error_says_why(tmp_path: Path, isolated_cache: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    model = convnets.se_resnext101_32x4d(**TINY["se_resnext101_32x4d"]).eval()
    with pytest.raises(ExportError) as info:
        export_model(model, tmp_path / "model.safetensors", format="timm")
    message = str(info.value)
    assert "fixed 16 channels with Linear layers" in message and "channels/16 with 1x1 convolutions" in message
    assert list(tmp_path.iterdir()) == []
    # The command says so before it downloads anything (--pretrained is export's default).
    out = tmp_path / "out"
    assert main(["export", "--model", "se_resnext101_32x4d", "--format", "timm", "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("convnets export: error: se_resnext101_32x4d cannot be written in timm's format")
    assert not out.exists() and not isolated_cache.exists()


def test_other_architectures_and_fp16_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ExportError, match=r"published resnet50 \(timm resnet50\), resnext101_32x4d"):
        export_model(convnets.resnet50(**TINY["resnet50"]), tmp_path / "model.safetensors", format="timm")
    with pytest.raises(convnets.InvalidArgumentError, match="fp32"):
        export_model(convnets.resnet50(**TINY["resnet50"]), tmp_path / "model.safetensors", format="timm",
                     precision="fp16")
    assert main(["export", "--model", "resnet50", "--random-init", "--format", "timm", "--precision", "fp16",
                 "--output", str(tmp_path / "out")]) == 1
    assert "fp32" in capsys.readouterr().err
    assert main(["export", "--model", "resnet50", "--random-init", "--format", "timm", "--triton",
                 "--output", str(tmp_path / "out")]) == 1
    assert "Triton has no backend for the timm format" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
