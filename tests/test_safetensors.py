"""safetensors: read everywhere a checkpoint is read, written self-describing, never unpickled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY, cli_in_process
from reference import reference_forward
from safetensors import safe_open
from test_checkpoints import LAYOUTS, _tiny_state

import convnets
from convnets.cli import main
from convnets.errors import CheckpointError, InvalidArgumentError
from convnets.weights.files import read_checkpoint
from convnets.weights.safetensors_io import is_safetensors, save_safetensors

SE = "se_resnext101_32x4d"
X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything calls torch.load (the only unpickler on the reading path)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a safetensors file reached torch.load")
    monkeypatch.setattr(torch, "load", refuse)


def _convert(src: Path, dst: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``convnets weights convert SRC DST`` in this process (one real subprocess run is below)."""
    assert main(["weights", "convert", str(src), str(dst)]) == 0
    assert str(dst) in capsys.readouterr().out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_convert_every_layout_then_load_model_alone(layout: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state = _tiny_state()
    src, dst = tmp_path / "in.pth.tar", tmp_path / "out.safetensors"
    torch.save(LAYOUTS[layout](state), src)
    _convert(src, dst, capsys)
    tolerance = dict(rtol=2e-2, atol=2e-2) if layout == "fp16 tensors" else dict(rtol=1e-4, atol=1e-5)

    # The file, read by the safetensors library alone: canonical keys and the recorded architecture.
    spec = convnets.get_model(SE, **TINY[SE]).spec
    with safe_open(str(dst), framework="pt") as f:
        metadata = f.metadata()
        keys = set(f.keys())
        torch.testing.assert_close(f.get_tensor("layer4.0.conv3.weight"), state["layer4.0.conv3.weight"], **tolerance)
    assert keys == set(state)  # num_batches_tracked included, no prefix, no layers.N
    assert json.loads(metadata["arch_spec"]) == spec.to_dict() and metadata["format"] == "pt"

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a safetensors file reached torch.load"))
    model = convnets.load_model(dst)
    assert model.spec == spec and not model.training
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), **tolerance)


def test_class_names_and_image_size_travel_in_the_metadata(tmp_path: Path) -> None:
    """Through ``convnets weights convert`` (the command line, in this process)."""
    state = _tiny_state(num_classes=3)
    spec = convnets.get_model(SE, **TINY[SE]).spec
    src = tmp_path / "train.pth.tar"
    torch.save({"state_dict": state, "arch_spec": spec.to_dict(), "class_names": ["cat", "dog", "fish"],
                "config": {"image_size": 64}, "epoch": 2}, src)
    dst = tmp_path / "model_best.safetensors"
    assert cli_in_process("weights", "convert", str(src), str(dst)).returncode == 0
    with safe_open(str(dst), framework="pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["class_names"]) == ["cat", "dog", "fish"] and metadata["image_size"] == "64"
    model = convnets.load_model(dst)
    assert (model.class_names, model.input_size, model.num_classes) == (["cat", "dog", "fish"], 64, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_save_safetensors_from_a_model_and_pretrained_from_file(tmp_path: Path, no_unpickling: None) -> None:
    torch.manual_seed(0)
    model = convnets.se_resnext101_32x4d(**TINY[SE]).eval()
    model.class_names = [f"c{i}" for i in range(model.num_classes)]
    path = save_safetensors(model, tmp_path / "m.safetensors", image_size=96)
    again = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    rebuilt = convnets.load_model(path)
    assert rebuilt.input_size == 96 and rebuilt.class_names == model.class_names
    with torch.no_grad():
        for other in (again, rebuilt):
            torch.testing.assert_close(other(X), model(X), rtol=0, atol=0)


def test_safetensors_tensors_are_memory_mapped(tmp_path: Path) -> None:
    path = save_safetensors(_tiny_state(), tmp_path / "w.safetensors")
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    with open(f"/proc/{os.getpid()}/maps") as f:
        ranges = [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in f
                  if line.rstrip().endswith(str(path))]
    assert ranges, "the safetensors file is not mapped"
    ptr = model.layer3[0].conv2.weight.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in ranges)


def test_detected_by_content_whatever_the_name(tmp_path: Path, no_unpickling: None) -> None:
    state = _tiny_state()
    path = save_safetensors(state, tmp_path / "weights.bin")
    assert is_safetensors(path)
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_pytorch_files_are_not_taken_for_safetensors(tmp_path: Path) -> None:
    torch.save(_tiny_state(), tmp_path / "zip.pth")
    torch.save(_tiny_state(), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert not is_safetensors(tmp_path / "zip.pth") and not is_safetensors(tmp_path / "legacy.pth")


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("content", ["pickle named .safetensors", "truncated", "garbage"])
def test_a_safetensors_file_never_unpickles(content: str, tmp_path: Path, no_unpickling: None) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "w.safetensors"
    if content == "pickle named .safetensors":
        import pickle
        path.write_bytes(pickle.dumps({"state_dict": _Exploit(marker)}))
    elif content == "truncated":
        save_safetensors(_tiny_state(), path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as info:
        read_checkpoint(path)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError):
        convnets.load_model(path)
    assert not marker.exists()


def test_foreign_safetensors_without_metadata_loads(tmp_path: Path) -> None:
    """E.g. timm's or a hub's file: no convnets metadata, the architecture is read off the shapes."""
    from safetensors.torch import save_file

    state = _tiny_state()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "hub.safetensors"),
              metadata={"format": "pt", "origin": "elsewhere"})
    checkpoint = read_checkpoint(tmp_path / "hub.safetensors")
    assert checkpoint["safetensors_metadata"] == {"origin": "elsewhere"} and "arch_spec" not in checkpoint
    with torch.no_grad():
        torch.testing.assert_close(convnets.load_model(tmp_path / "hub.safetensors")(X), reference_forward(state, X),
                                   rtol=1e-4, atol=1e-5)


def test_shared_tensors_are_written(tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    path = save_safetensors({"a": w, "b": w, "c": w[1]}, tmp_path / "shared.safetensors")
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("b"), w) and torch.equal(f.get_tensor("c"), w[1])


@pytest.mark.parametrize("kwargs, match", [(dict(class_names="cat"), "class_names"),
                                           (dict(image_size=0), "image_size"),
                                           (dict(arch_spec={"layers": [1]}), "arch_spec")])
def test_save_safetensors_checks_its_arguments(kwargs: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        save_safetensors(_tiny_state(), tmp_path / "x.safetensors", **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, message", [(["weights", "convert", "only-one"], "two files"),
                                           (["weights", "convert", "a.pth", "b.pth"], "must end in .safetensors")])
def test_convert_usage_errors(args: list[str], message: str) -> None:
    result = cli_in_process(*args)
    assert result.returncode != 0 and message in result.stderr



def test_convert_replaces_an_existing_out_file_only_with_force(tmp_path: Path) -> None:
    src = tmp_path / "tiny.pth"
    torch.save(_tiny_state(), src)
    kept = tmp_path / "precious.safetensors"
    kept.write_bytes(b"the user's own file")
    link = tmp_path / "out.safetensors"
    link.symlink_to(kept)
    for dst in (kept, link):
        refused = cli_in_process("weights", "convert", str(src), str(dst))
        assert refused.returncode != 0 and f"{dst} exists" in refused.stderr and "--force" in refused.stderr
    assert kept.read_bytes() == b"the user's own file"
    assert cli_in_process("weights", "convert", str(src), str(link), "--force").returncode == 0
    assert not link.is_symlink() and kept.read_bytes() == b"the user's own file"  # the link replaced, not followed
    assert set(convnets.load_model(link).state_dict()) == set(convnets.load_model(src).state_dict())
