"""torch.hub from a plain checkout, and the installed wheel (manifest and data files included)."""

from __future__ import annotations

import json
import os
import shutil
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
        assert text.startswith(getattr(convnets, name).__doc__.splitlines()[0]) and f"help(convnets.{name})" in text


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
    """The wheel that ``pip install .`` builds, from a clean copy of the checkout.

    An in-place build reuses build/ and *.egg-info from earlier builds, which would hide a missing
    package or package_data entry. The copy leaves out the virtual environment that .ci/run makes
    in the checkout (copying it took 30 s of each CI run).
    """
    out = tmp_path_factory.mktemp("wheel")
    source = out / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".venv-serve", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "tests",
        "benchmarks"))
    # No build isolation: the test must not need the network to fetch setuptools.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("convnets_hub-*.whl")  # the distribution convnets-hub (tests/test_packaging_name.py)
    return wheel


def test_wheel_ships_the_example_photos(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n: zf.read(n) for n in zf.namelist() if n.startswith("convnets/assets/examples/")}
    # The photos and their licenses; notebooks in examples/ are for copying from a clone, not package data.
    assert sorted(Path(n).name for n in shipped) == ["LICENSES.md", "chelsea.png", "coffee.png", "rocket.jpg"]
    for name, data in shipped.items():  # the files themselves, not a link
        assert data == (REPO / name).read_bytes(), name


def test_wheel_contains_manifest_and_class_names(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        manifest = json.loads(zf.read("convnets/weights_manifest.json"))
        constraints = zf.read("convnets/constraints.txt")  # what an installed copy's install hints pass to pip
    assert manifest == json.loads((REPO / "weights_manifest.json").read_text())
    assert constraints == (REPO / "constraints.txt").read_bytes()
    assert "convnets/preprocessing/imagenet_classes.tsv" in names
    assert {"convnets/py.typed", "processing_utils/py.typed"} <= names  # PEP 561: the annotations are used
    assert "hubconf.py" not in names and not any(n.startswith("tests/") for n in names)
    assert any(n.startswith("convnets_hub-") and n.endswith("/LICENSE") for n in names)  # license_files


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the wheel installed (not ``-e``); returns its ``bin`` directory.

    The dependencies (PyTorch and the rest, gigabytes) come from this interpreter's site-packages
    through a ``.pth`` line, so the environment costs seconds. Python does not read ``.pth`` files in
    a directory that a ``.pth`` line adds, so the checkout's editable install stays invisible there:
    ``convnets`` can only come from the wheel.
    """
    import sysconfig

    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    # This interpreter's pip (found through the .pth line) installs into the new environment and writes
    # its console script there; --ignore-installed: the checkout's editable install is visible to pip.
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                    "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return venv / "bin"


def _installed_run(bin_dir: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


#: Modules that are not imported here: ``__main__`` modules run a command; the model.py that export copies
#: into Python-backend Triton repositories imports Triton's own ``triton_python_backend_utils``.
NOT_IMPORTED = {"convnets.deploy.triton.python_backend"}


def _source_modules() -> set[str]:
    """Every module of the source tree, by name (``convnets.data.folders``, ``processing_utils``)."""
    names = set()
    for top in ("convnets", "processing_utils"):
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_installed_wheel_has_and_imports_every_module(installed: Path, tmp_path: Path) -> None:
    script = (
        "import importlib, json, pkgutil, convnets, processing_utils\n"
        "from convnets.weights.manifest import load_manifest\n"
        f"NOT_IMPORTED = {sorted(NOT_IMPORTED)!r}\n"
        "names = {'convnets', 'processing_utils'}\n"
        "for top in (convnets, processing_utils):\n"
        "    names |= {m.name for m in pkgutil.walk_packages(top.__path__, top.__name__ + '.')}\n"
        "failed = {}\n"
        "for name in sorted(n for n in names if not n.endswith('.__main__') and n not in NOT_IMPORTED):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as e:\n"
        "        failed[name] = str(e)\n"
        "m = load_manifest()\n"
        "print(json.dumps({'file': convnets.__file__, 'modules': sorted(names), 'failed': failed, 'models': sorted(m),"
        " 'params': {k: v.num_params for k, v in m.items()}, 'classes': len(processing_utils.get_imgnet_classes())}))\n"
    )
    done = _installed_run(installed, "python", "-c", script, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["file"].startswith(str(installed.parent)), report["file"]
    # Every module of the source tree is in the wheel (a folder without __init__.py is not), and imports.
    assert set(report["modules"]) == _source_modules()
    # Optional runtimes' modules import without them too (their imports are lazy); DALI's needs DALI.
    assert report["failed"] == {}
    assert report["models"] == sorted(json.loads((REPO / "weights_manifest.json").read_text())["models"])
    assert {"resnet50", "resnext101_32x4d", "se_resnext101_32x4d"} <= set(report["models"])
    assert report["params"]["se_resnext101_32x4d"] == 45_251_128
    assert report["classes"] == 1000
    listed = _installed_run(installed, "convnets", "weights", "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert [row["model"] for row in json.loads(listed.stdout)] == report["models"]


@pytest.mark.slow
def test_installed_wheel_trains_evaluates_predicts_and_embeds(installed: Path, tmp_path: Path) -> None:
    """The README's install, used as a new user would: every command that needs a subpackage."""
    from train_support import TINY_ARCH, make_digits

    data = make_digits(tmp_path / "digits", n_train=64, n_val=32, size=32, digits=(0, 1))
    out = tmp_path / "run"
    trained = _installed_run(installed, "convnets", "train", "--data", str(data), "--output", str(out),
                             "--arch", "resnet50", "--arch-kwargs", json.dumps(TINY_ARCH), "--image-size", "32",
                             "--batch-size", "32", "--epochs", "1", "--warmup-epochs", "0", "--workers", "0",
                             "--no-progress", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    weights = out / "model_best.pth.tar"
    assert weights.is_file()

    evaluated = _installed_run(installed, "convnets", "evaluate", "--data", str(data / "val"), "--weights",
                               str(weights), "--workers", "0", "--output", str(tmp_path / "eval"), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["images"] == 32

    images = sorted((data / "val").rglob("*.png"))[:3]
    # Two classes and no --topk: every class, best first (the default fits the model).
    predicted = _installed_run(installed, "convnets", "predict", "--weights", str(weights), "--jsonl",
                               *map(str, images), cwd=tmp_path)
    assert predicted.returncode == 0, predicted.stderr
    records = [json.loads(line) for line in predicted.stdout.splitlines()]
    assert [r["input"] for r in records] == [str(p) for p in images]
    assert all(sorted(t["label"] for t in r["top"]) == ["digit0", "digit1"] for r in records)

    vectors = tmp_path / "vectors.npy"
    embedded = _installed_run(installed, "convnets", "embed", "--weights", str(weights), "--output", str(vectors),
                              *map(str, images), cwd=tmp_path)
    assert embedded.returncode == 0, embedded.stderr
    import numpy as np

    assert np.load(vectors).shape == (3, 128)
