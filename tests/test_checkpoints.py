"""Loading checkpoints of every layout found in the wild, and refusing the ones that do not fit."""

from __future__ import annotations

import os
import random
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, randomize_bn
from reference import reference_forward

import convnets
from convnets.errors import CheckpointError
from convnets.train.checkpoint import get_rng_state, set_rng_state
from convnets.train.checkpoint import FORMAT, TrainingCheckpoint
from convnets.weights.record import STATE_DICT_EMA

SE = "se_resnext101_32x4d"
X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def _tiny_state(name: str = SE, seed: int = 0, **kw: object) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return randomize_bn(convnets.get_model(name, **{**TINY[name], **kw}), seed).state_dict()


def _layers_n(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Newer upstream layout: ``layers.{0..3}`` and SE weights as 1x1 convolutions."""
    out = {}
    for k, v in state.items():
        if k.startswith("layer"):
            stage, rest = k.split(".", 1)
            k = f"layers.{int(stage[len('layer'):]) - 1}.{rest}"
        if k.endswith(("squeeze.squeeze.weight", "squeeze.expand.weight")):
            v = v[:, :, None, None]
        out[k] = v
    return out


LAYOUTS: dict[str, Callable[[dict], object]] = {
    "plain state dict": lambda sd: sd,
    "NGC 20.06 (module. prefix)": lambda sd: {f"module.{k}": v for k, v in sd.items()},
    "layers.N with 4-D SE": _layers_n,
    "layers.N, module. prefix": lambda sd: {f"module.{k}": v for k, v in _layers_n(sd).items()},
    "torch.compile prefix": lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()},
    "upstream training checkpoint": lambda sd: {"epoch": 90, "best_prec1": np.float64(80.1), "arch": "se-resnext101-32x4d",
                                                "state_dict": {f"module.{k}": v for k, v in sd.items()},
                                                "optimizer": {"state": {}, "param_groups": []}},
    "torchvision/timm training checkpoint": lambda sd: {"model": sd, "epoch": 3},
    "fp16 tensors": lambda sd: {k: v.half() if v.is_floating_point() else v for k, v in sd.items()},
    "no num_batches_tracked": lambda sd: {k: v for k, v in sd.items() if "num_batches_tracked" not in k},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_through_pretrained_from_file(layout: str, tmp_path: Path) -> None:
    state = _tiny_state()
    path = tmp_path / "ckpt.pth.tar"
    torch.save(LAYOUTS[layout](state), path)
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    assert not model.training
    tolerance = dict(rtol=2e-2, atol=2e-2) if layout == "fp16 tensors" else dict(rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), **tolerance)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_pretrained_from_file_wins_over_pretrained_true(tmp_path: Path, closed_port_url: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream asserted that both were not given; here the file is the source and nothing downloads."""
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", closed_port_url)  # a download would fail
    state = _tiny_state()
    torch.save(state, tmp_path / "w.pth")
    model = convnets.se_resnext101_32x4d(pretrained=True, pretrained_from_file=tmp_path / "w.pth", **TINY[SE])
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_legacy_non_zip_checkpoint_loads_without_mmap(tmp_path: Path) -> None:
    state = _tiny_state()
    path = tmp_path / "legacy.pth.tar"
    torch.save({f"module.{k}": v for k, v in state.items()}, path, _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(path)
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_checkpoint_written_by_numpy_1_loads(tmp_path: Path) -> None:
    """numpy 1.x pickles name the scalar reconstructor numpy.core.multiarray.scalar."""
    state = _tiny_state()
    modern = tmp_path / "modern.pth"
    torch.save({"state_dict": state, "best_prec1": np.float64(79.5)}, modern)
    old = tmp_path / "numpy1.pth"
    with zipfile.ZipFile(modern) as src, zipfile.ZipFile(old, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray\nscalar" in data
                data = data.replace(b"numpy._core.multiarray\nscalar", b"numpy.core.multiarray\nscalar")
            dst.writestr(info, data)
    model = convnets.load_model(old)
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_timm_resnext_state_dict_loads(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    from timm.models.resnet import Bottleneck, ResNet

    torch.manual_seed(3)
    # timm's resnext101_32x4d is ResNet(Bottleneck, [3, 4, 23, 3], cardinality=32, base_width=4);
    # the same class at a tenth of the depth and width keeps its key naming.
    ref = randomize_bn(ResNet(block=Bottleneck, layers=[1, 2, 1, 1], cardinality=4, base_width=16)).eval()
    torch.save(ref.state_dict(), tmp_path / "timm.pth")
    model = convnets.resnext101_32x4d(pretrained_from_file=tmp_path / "timm.pth", layers=[1, 2, 1, 1],
                                      widths=[64, 128, 256, 512], expansion=4, cardinality=4)
    with torch.no_grad():
        torch.testing.assert_close(model(X), ref(X), rtol=1e-4, atol=1e-4)
    del timm


def test_timm_seresnext_is_refused_with_an_explanation(tmp_path: Path) -> None:
    pytest.importorskip("timm")
    from timm.models.resnet import Bottleneck, ResNet

    other = ResNet(block=Bottleneck, layers=[1, 2, 1, 1], cardinality=4, base_width=4,
                   block_args=dict(attn_layer="se"))
    torch.save(other.state_dict(), tmp_path / "timm_se.pth")
    with pytest.raises(CheckpointError) as info:
        convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "timm_se.pth", **TINY[SE])
    message = str(info.value)
    assert "se_resnext101_32x4d" in message and "timm" in message and "se.fc1" in message
    assert len(message) < 1500  # short and actionable, not a dump of hundreds of keys


def test_checkpoint_of_another_model_names_it(tmp_path: Path) -> None:
    torch.save(_tiny_state("resnext101_32x4d"), tmp_path / "plain.pth")
    with pytest.raises(CheckpointError) as info:
        convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "plain.pth", **TINY[SE])
    message = str(info.value)
    assert "missing" in message and "squeeze" in message and "load_model" in message
    assert len(message) < 1500


@pytest.mark.parametrize("num_classes", [10, 1000])
def test_num_classes_keeps_backbone_and_replaces_head(num_classes: int, tmp_path: Path) -> None:
    state = _tiny_state(num_classes=100)
    torch.save(state, tmp_path / "w.pth")
    model = convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "w.pth", num_classes=num_classes,
                                         **TINY[SE])
    assert model.fc.weight.shape == (num_classes, model.num_features)
    with torch.no_grad():
        features = model.forward_head(model.forward_features(X), pre_logits=True)
        logits = model(X)
    expected_features = reference_forward({**state, "fc.weight": torch.eye(model.num_features),
                                           "fc.bias": torch.zeros(model.num_features)}, X)
    torch.testing.assert_close(features, expected_features, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, torch.nn.functional.linear(features, model.fc.weight, model.fc.bias))


def test_num_classes_none_keeps_checkpoint_head(tmp_path: Path) -> None:
    torch.save(_tiny_state(num_classes=7), tmp_path / "w.pth")
    assert convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "w.pth", **TINY[SE]).num_classes == 7


def test_state_dict_key_map_fn_is_applied_first(tmp_path: Path) -> None:
    """Upstream's documented workaround (remap to ``layers.N``) still works; as upstream, the map
    sees each key with ``module.`` already stripped (SPEC section 7)."""
    state = _tiny_state()
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "w.pth")

    def to_sequential(key: str) -> str:
        head, _, rest = key.partition(".")
        return f"layers.{int(head[5:]) - 1}.{rest}" if head.startswith("layer") else key

    calls = []
    model = convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "w.pth",
                                         state_dict_key_map_fn=lambda k: calls.append(k) or to_sequential(k),
                                         **TINY[SE])
    assert sorted(calls) == sorted(state)  # every key once, none with "module."
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def _backbone_only(key: str) -> str:
    return key[len("backbone."):]


@pytest.mark.parametrize("layout", ["DDP wrapper (module.backbone.)", "wrapper training checkpoint",
                                    "plain wrapper (backbone.)"])
def test_key_map_of_an_upstream_user_loads_a_wrapper_checkpoint(layout: str, tmp_path: Path) -> None:
    """A classifier saved inside a wrapper module under DDP: upstream loads it with a map that drops
    ``backbone.``, because it strips ``module.`` before calling the map."""
    state = _tiny_state()
    wrapped = {f"module.backbone.{k}": v for k, v in state.items()}
    obj = {"wrapper training checkpoint": {"state_dict": wrapped, "epoch": 3},
           "plain wrapper (backbone.)": {f"backbone.{k}": v for k, v in state.items()}}.get(layout, wrapped)
    torch.save(obj, tmp_path / "w.pth")
    model = convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "w.pth",
                                         state_dict_key_map_fn=_backbone_only, **TINY[SE])
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_wrapper_prefixes_are_stripped_in_any_nesting(tmp_path: Path) -> None:
    """torch.compile of a DDP model saves ``_orig_mod.module.``; DDP of a compiled one ``module._orig_mod.``."""
    state = _tiny_state()
    for prefix in ("_orig_mod.module.", "module._orig_mod."):
        torch.save({f"{prefix}{k}": v for k, v in state.items()}, tmp_path / "w.pth")
        model = convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "w.pth", **TINY[SE])
        with torch.no_grad():
            torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_ema_weights_are_selectable(tmp_path: Path) -> None:
    live, ema = _tiny_state(seed=1), _tiny_state(seed=2)
    torch.save({"state_dict": live, "state_dict_ema": ema, "epoch": 1}, tmp_path / "t.pth")
    model = convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "t.pth", use_ema=True, **TINY[SE])
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(ema, X), rtol=1e-4, atol=1e-5)
    torch.save({"state_dict": live}, tmp_path / "no_ema.pth")
    with pytest.raises(CheckpointError, match="state_dict_ema"):
        convnets.load_model(tmp_path / "no_ema.pth", use_ema=True)


def test_load_model_rebuilds_architecture_head_and_class_names(tmp_path: Path) -> None:
    state = _tiny_state(num_classes=3)
    names = ["cat", "dog", "fish"]
    spec = convnets.get_model(SE, **TINY[SE]).spec
    torch.save({"state_dict": state, "arch_spec": spec.to_dict(), "class_names": names}, tmp_path / "a.pth")
    torch.save(state, tmp_path / "b.pth")  # no metadata: the architecture is read off the shapes
    for path, expected_names in ((tmp_path / "a.pth", names), (tmp_path / "b.pth", None)):
        model = convnets.load_model(path)
        assert model.spec == spec and model.num_classes == 3 and model.class_names == expected_names
        with torch.no_grad():
            torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-5)


def test_weights_are_memory_mapped_not_copied(tmp_path: Path) -> None:
    """Zip checkpoints are mmapped: tensors point into the file's mapping, not into fresh copies."""
    state = _tiny_state()
    path = tmp_path / "w.pth"
    torch.save(state, path)
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    with open(f"/proc/{os.getpid()}/maps") as f:
        mapped = [line.split()[0] for line in f if line.rstrip().endswith(str(path))]
    assert mapped, "the checkpoint file is not mapped"
    ranges = [tuple(int(a, 16) for a in r.split("-")) for r in mapped]
    ptr = model.layer3[0].conv2.weight.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in ranges)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    state = _tiny_state()
    torch.save({"state_dict": state, "payload": _Exploit(marker)}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match=r"refusing to load .*(posix|os)\.system"):
        convnets.se_resnext101_32x4d(pretrained_from_file=tmp_path / "evil.pth", **TINY[SE])
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"hello", b"<html>not a checkpoint</html>", "random bytes",
                                     "truncated zip", "truncated legacy"])
def test_unreadable_files_raise_checkpoint_error(content: object, tmp_path: Path) -> None:
    path = tmp_path / "bad.pth"
    if content == "random bytes":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    elif isinstance(content, str):
        torch.save(_tiny_state(), path, _use_new_zipfile_serialization=content == "truncated zip")
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match="is not a PyTorch checkpoint") as info:
        convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    assert str(path) in str(info.value) and len(str(info.value)) < 400


def test_missing_file_raises_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        convnets.load_model(tmp_path / "nope.pth")


def test_pickled_model_object_is_explained(tmp_path: Path) -> None:
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="state_dict"):
        convnets.load_model(tmp_path / "list.pth")


# The training checkpoint's schema (convnets.train.checkpoint.TrainingCheckpoint).

def _training_checkpoint(**changes: object) -> TrainingCheckpoint:
    model = convnets.get_model(SE, num_classes=3, **TINY[SE])
    fields: dict[str, object] = dict(state_dict=model.state_dict(), optimizer={"state": {}}, scheduler={"last_epoch": 4},
                                     epoch=2, arch_spec=model.spec.to_dict(), class_names=["a", "b", "c"],
                                     config={"image_size": 48})
    return TrainingCheckpoint(**{**fields, **changes})


def test_training_checkpoint_round_trip_and_load_model(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth.tar"
    written = _training_checkpoint(history=[{"epoch": 1, "val_top1": 50.0}], best_top1=50.0, best_epoch=1)
    written.write(path)
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temporary file left behind
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == FORMAT and STATE_DICT_EMA not in raw and "ema_updates" not in raw
    read = TrainingCheckpoint.read(path)
    assert read.epoch == 2 and read.history == written.history and read.best_top1 == 50.0
    assert read.class_names == ["a", "b", "c"] and read.model_spec() == written.model_spec()
    model = convnets.load_model(path)  # the registry reads the same file through the schema
    assert model.class_names == ["a", "b", "c"] and model.input_size == 48 and model.spec == read.model_spec()


@pytest.mark.parametrize("damage, message", [
    (lambda d: d.pop("optimizer"), "is not a convnets training checkpoint (no optimizer)"),
    (lambda d: d.update(epoch="2"), "epoch (str, expected an int >= 0)"),
    (lambda d: d.update(class_names=[1, 2, 3]), "class_names (list, expected a list of str)"),
    (lambda d: d.update(format="convnets-train/2"), "format 'convnets-train/2'"),
])
def test_training_checkpoint_validation(damage: Callable[[dict[str, object]], object], message: str,
                                        tmp_path: Path) -> None:
    data = _training_checkpoint().to_dict()
    damage(data)
    torch.save(data, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match=re.escape(message)):
        TrainingCheckpoint.read(tmp_path / "bad.pth", hint="use something else")
    with pytest.raises(CheckpointError, match="use something else"):
        TrainingCheckpoint.read(tmp_path / "bad.pth", hint="use something else")


def test_rng_state_survives_a_checkpoint_file(tmp_path: Path) -> None:
    """The global generators' state, written and read back through a real checkpoint file."""
    torch.manual_seed(11), np.random.seed(11), random.seed(11)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    random.gauss(0, 1)
    state = get_rng_state()
    expected = _draws()
    _training_checkpoint(rng=state).write(tmp_path / "c.pth")
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    set_rng_state(TrainingCheckpoint.read(tmp_path / "c.pth").rng)
    assert _draws() == expected


def _draws() -> tuple[list[float], ...]:
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), [np.random.standard_normal() for _ in range(2)],
            [random.random() for _ in range(3)], [random.gauss(0, 1) for _ in range(2)])
