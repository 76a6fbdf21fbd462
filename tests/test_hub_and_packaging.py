"""torch.hub from a plain checkout, and the installed wheel (manifest and data files included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY
from reference import reference_forward

import convnets
from convnets.models.specs import MODEL_SPECS, MODELS, registered_name

#: upstream's entry points (NVIDIA/DeepLearningExamples:torchhub): this checkout must keep them all.
UPSTREAM_ENTRIES = ["nvidia_convnets_processing_utils", "nvidia_resneXt", "nvidia_resnet50",
                    "nvidia_resnext101_32x4d", "nvidia_se_resnext101_32x4d"]
UPSTREAM_MODEL_ENTRIES = {"nvidia_resnet50": "resnet50", "nvidia_resneXt": "resnext101_32x4d",
                          "nvidia_resnext101_32x4d": "resnext101_32x4d",
                          "nvidia_se_resnext101_32x4d": "se_resnext101_32x4d"}
#: hub entry point -> registered model, as the registry declares them
MODEL_ENTRIES = {hub: info.name for info in MODELS.values() for hub in info.hub_names}
ENTRIES = sorted(["nvidia_convnets_processing_utils", *MODEL_ENTRIES])


UPSTREAM_REPO = "NVIDIA/DeepLearningExamples:torchhub"


@pytest.fixture
def upstream_name(isolated_cache: Path) -> str:
    """Upstream's hub string, resolved to this checkout through torch.hub's repository cache.

    torch.hub.list / help only take GitHub repositories; with the repository already in the cache
    (hub_dir/<owner>_<name>_<ref>) torch.hub uses it without touching the network.
    """
    hub_dir = isolated_cache.parent
    hub_dir.mkdir(parents=True, exist_ok=True)
    (hub_dir / "NVIDIA_DeepLearningExamples_torchhub").symlink_to(REPO, target_is_directory=True)
    return UPSTREAM_REPO


def test_hub_lists_the_upstream_entry_points(upstream_name: str) -> None:
    listed = sorted(torch.hub.list(upstream_name, trust_repo=True, verbose=False))
    assert listed == ENTRIES
    assert set(UPSTREAM_ENTRIES) <= set(listed)
    assert UPSTREAM_MODEL_ENTRIES.items() <= MODEL_ENTRIES.items()


def test_every_registered_model_has_a_hub_entry_point_and_vice_versa(upstream_name: str) -> None:
    """What each listed entry point builds, not what it is called: together they cover the registry."""
    built = {}
    for entry in torch.hub.list(upstream_name, trust_repo=True, verbose=False):
        if entry == "nvidia_convnets_processing_utils":
            continue
        model = torch.hub.load(upstream_name, entry, trust_repo=True, verbose=False, pretrained=False,
                               device="meta")
        built[entry] = registered_name(model.spec)
    assert built == MODEL_ENTRIES
    assert set(built.values()) == set(convnets.list_models())


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_has_help(entry: str, upstream_name: str) -> None:
    text = torch.hub.help(upstream_name, entry, trust_repo=True)
    assert text and len(text.strip()) > 40
    if entry in MODEL_ENTRIES:
        name = MODEL_ENTRIES[entry]
        assert text.startswith(MODELS[name].summary.splitlines()[0]) and f"help(convnets.{name})" in text


def test_upstream_hub_string_loads_this_code(upstream_name: str, full_se_checkpoint,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path, state = full_se_checkpoint
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(path.parent))
    model = torch.hub.load(upstream_name, "nvidia_se_resnext101_32x4d", trust_repo=True, verbose=False,
                           progress=False)
    assert torch.equal(model.fc.bias, state["fc.bias"])


@pytest.mark.parametrize("entry, name", sorted(MODEL_ENTRIES.items()))
def test_hub_load_builds_the_architecture(entry: str, name: str) -> None:
    model = torch.hub.load(str(REPO), entry, source="local", pretrained=False, **TINY[name])
    assert model.spec.se_squeeze == (16 if "se_" in name else None)
    assert model.spec == MODEL_SPECS[name].replace(**TINY[name])
    assert model.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 1000)


def test_hub_load_pretrained_by_default_through_mirror(full_se_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's call, unchanged but for the repository argument."""
    path, state = full_se_checkpoint
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(path.parent))
    model = torch.hub.load(str(REPO), "nvidia_se_resnext101_32x4d", source="local", progress=False)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_forward(state, x), rtol=1e-4, atol=1e-4)


def test_hub_pretrained_from_file_with_ngc_file(full_se_checkpoint) -> None:
    """Upstream issue #1268: an NGC file given as pretrained_from_file must load."""
    path, state = full_se_checkpoint
    model = torch.hub.load(str(REPO), "nvidia_se_resnext101_32x4d", source="local", pretrained_from_file=str(path))
    assert torch.equal(model.layer3[5].squeeze.expand.weight, state["layer3.5.squeeze.expand.weight"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the test must not need the network to fetch setuptools.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(REPO)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("convnets_hub-*.whl")  # the distribution convnets-hub (tests/test_packaging_name.py)
    return wheel


def test_wheel_contains_manifest_and_class_names(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        manifest = json.loads(zf.read("convnets/weights_manifest.json"))
    assert manifest == json.loads((REPO / "weights_manifest.json").read_text())
    assert "convnets/preprocessing/imagenet_classes.tsv" in names
    assert {"convnets/py.typed", "processing_utils/py.typed"} <= names  # PEP 561: the annotations are used
    assert "hubconf.py" not in names and not any(n.startswith("tests/") for n in names)
    assert any(n.startswith("convnets_hub-") and n.endswith("/LICENSE") for n in names)  # license_files


def test_installed_wheel_works_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    script = (
        "import convnets, processing_utils, json, sys\n"
        "from convnets.weights.manifest import load_manifest\n"
        "m = load_manifest()\n"
        "print(json.dumps({'file': convnets.__file__, 'models': sorted(m),"
        " 'params': {k: v.num_params for k, v in m.items()}, 'classes': len(processing_utils.get_imgnet_classes())}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["file"].startswith(str(target))
    assert report["models"] == sorted(json.loads((REPO / "weights_manifest.json").read_text())["models"])
    assert {"resnet50", "resnext101_32x4d", "se_resnext101_32x4d"} <= set(report["models"])
    assert report["params"]["se_resnext101_32x4d"] == 45_251_128
    assert report["classes"] == 1000
    console = target / "bin" / "convnets"
    assert console.is_file()
    listed = subprocess.run([sys.executable, str(console), "weights", "--json"], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert [row["model"] for row in json.loads(listed.stdout)] == report["models"]
