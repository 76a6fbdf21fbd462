"""Embeddings (``convnets embed``, ``convnets.embed``): pooled stage outputs checked against an
independent forward pass, .npy / .parquet read back with numpy and pyarrow, resume after SIGKILL,
unreadable inputs, and the spool's torn-tail repair."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, kill_midway, randomize_bn, run_cli
from PIL import Image
from reference import _bn, _block
from strict_skips import require_module
from torchvision import transforms

import convnets
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inference.outputs import Output
from convnets.inference.outputs.spool import read_spool, scan, spool_path, write_spool

ARCH = "se_resnext101_32x4d"
IMAGE_SIZE = 40
N_IMAGES = 40
BAD = ["b_truncated.png", "c_corrupt.jpg", "d_notes.jpg"]


@pytest.fixture(scope="module")
def model() -> convnets.ResNet:
    """A small SE-ResNeXt (grouped convolutions, SE gates, downsampling) with non-trivial BatchNorm."""
    torch.manual_seed(0)
    return randomize_bn(convnets.get_model(ARCH, **TINY[ARCH])).eval()


@pytest.fixture(scope="module")
def checkpoint(model: convnets.ResNet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Smooth random images (not noise, so that features vary smoothly) and three unreadable files."""
    root = tmp_path_factory.mktemp("embed_images")
    rng = np.random.default_rng(1)
    for i in range(N_IMAGES):
        small = rng.integers(0, 255, (6, 8, 3), dtype=np.uint8)
        Image.fromarray(small).resize((64 + i, 48), Image.BICUBIC).save(root / f"img{i:03d}.{'png' if i % 2 else 'jpg'}")
    good = (root / "img001.png").read_bytes()
    (root / BAD[0]).write_bytes(good[: len(good) // 2])
    (root / BAD[1]).write_bytes(b"\xff\xd8\xff" + bytes(64))
    (root / BAD[2]).write_text("not an image")
    return root


def _names(images: Path) -> list[str]:
    return sorted(str(p) for p in images.iterdir())


def _independent(model: convnets.ResNet, paths: list[str], layer: int, image_size: int = IMAGE_SIZE) -> np.ndarray:
    """Pooled ``layer<k>`` features by torchvision preprocessing and tests/reference.py's functional
    forward pass (no convnets code: no folding, contiguous layout), in float64."""
    preprocess = transforms.Compose([
        transforms.Resize(round(image_size * 256 / 224), interpolation=transforms.InterpolationMode.BILINEAR),
        transforms.CenterCrop(image_size), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    x = torch.stack([preprocess(Image.open(p).convert("RGB")) for p in paths]).double()
    sd = {k: v.double() for k, v in model.state_dict().items()}
    with torch.no_grad():
        x = F.max_pool2d(F.relu(_bn(F.conv2d(x, sd["conv1.weight"], stride=2, padding=3), sd, "bn1")), 3, 2, 1)
        for stage in range(1, layer + 1):
            block = 0
            while f"layer{stage}.{block}.conv1.weight" in sd:
                x = _block(x, sd, f"layer{stage}.{block}", 2 if stage > 1 and block == 0 else 1)
                block += 1
    return x.mean(dim=(2, 3)).numpy()


@pytest.mark.parametrize("layer", [1, 2, 3, 4])
def test_vectors_match_an_independent_forward_pass(model: convnets.ResNet, images: Path, layer: int) -> None:
    good = [n for n in _names(images) if Path(n).name.startswith("img")][:10]
    got = list(convnets.embed(model, good, layer=f"layer{layer}", image_size=IMAGE_SIZE, batch_size=4))
    assert [name for name, _ in got] == good
    vectors = np.stack([v for _, v in got])
    expected = _independent(model, good, layer)
    channels = TINY[ARCH]["widths"][layer - 1] * model.spec.expansion
    assert vectors.shape == expected.shape == (10, channels) and vectors.dtype == np.float32
    # float32 with BatchNorm folded and channels_last against float64 unfolded: rounding only, ~1e-6
    # of the vectors' scale here; 1e-4 (optimize_for_inference's fp32 criterion) leaves a margin that
    # a wrong stage, a missing ReLU or another pooling (differences of order 1) cannot hide in.
    scale = np.abs(expected).max()
    np.testing.assert_allclose(vectors, expected, rtol=1e-4, atol=1e-4 * scale)
    normalized = np.stack([v for _, v in convnets.embed(model, good[:5], layer=f"layer{layer}", normalize=True,
                                                         image_size=IMAGE_SIZE)])
    np.testing.assert_allclose(normalized, expected[:5] / np.linalg.norm(expected[:5], axis=1, keepdims=True),
                               rtol=1e-4, atol=1e-5)


def test_library_errors_and_workers(model: convnets.ResNet, images: Path, caplog: pytest.LogCaptureFixture) -> None:
    names = _names(images)
    inline = list(convnets.embed(model, str(images), image_size=IMAGE_SIZE, batch_size=4))
    assert [n for n, _ in inline] == [n for n in names if Path(n).name.startswith("img")]
    assert sum("skipping" in r.message for r in caplog.records) == 3  # each unreadable input logged
    parallel = list(convnets.embed(model, [str(images)], image_size=IMAGE_SIZE, batch_size=4, workers=2))
    assert [n for n, _ in parallel] == [n for n, _ in inline]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(inline, parallel))  # same tensors, same vectors
    with pytest.raises(ImageLoadError, match="b_truncated.png"):
        list(convnets.embed(model, [str(images)], image_size=IMAGE_SIZE, on_error="raise"))
    with pytest.raises(InvalidArgumentError, match=r"layer='layer5' is not a stage"):
        list(convnets.embed(model, names[:1], layer="layer5"))
    with pytest.raises(InvalidArgumentError, match="need a convnets ResNet"):
        list(convnets.embed(torch.nn.Linear(2, 2), names[:1]))  # type: ignore[arg-type]


def _embed(checkpoint: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_cli("embed", "--weights", str(checkpoint), "--image-size", str(IMAGE_SIZE), "--batch-size", "4",
                   "--no-progress", *args, timeout=timeout)


@pytest.fixture(scope="module")
def reference(checkpoint: Path, images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted run per format: the files and stderr."""
    pq = require_module("pyarrow.parquet")
    out = tmp_path_factory.mktemp("embed_out")
    npy, parquet = out / "all.npy", out / "all.parquet"
    done = _embed(checkpoint, str(images), "--output", str(npy))
    assert done.returncode == 1, done.stderr
    again = _embed(checkpoint, str(images), "--output", str(parquet), "--workers", "0")
    assert again.returncode == 1, again.stderr
    return {"vectors": np.load(npy), "inputs": (out / "all.npy.inputs.txt").read_text().splitlines(),
            "table": pq.read_table(parquet), "stderr": done.stderr, "dir": out}


def test_npy_and_parquet_read_back(reference: dict, model: convnets.ResNet, images: Path) -> None:
    good = [n for n in _names(images) if Path(n).name.startswith("img")]
    vectors, inputs, table = reference["vectors"], reference["inputs"], reference["table"]
    assert inputs == good and vectors.shape == (N_IMAGES, model.num_features) and vectors.dtype == np.float32
    assert table.column_names == ["input", "embedding"] and table.column("input").to_pylist() == good
    pa = require_module("pyarrow")
    kind = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and kind.list_size == model.num_features
    assert kind.value_type == pa.float32()
    from_parquet = np.stack([np.asarray(v, dtype=np.float32) for v in table.column("embedding").to_pylist()])
    np.testing.assert_array_equal(from_parquet, vectors)  # workers 1 (npy) and 0 (parquet): the same numbers
    library = np.stack([v for _, v in convnets.embed(model, good, image_size=IMAGE_SIZE, batch_size=4)])
    # The command runs --engine auto (its default: OpenVINO here), checked to 1e-4 of the largest value;
    # the library's default is the torch engine.
    np.testing.assert_allclose(vectors, library, rtol=0, atol=1e-4 * float(np.abs(library).max()))
    errors = [line for line in reference["stderr"].splitlines() if line.startswith("convnets embed: error:")]
    assert [next(b for b in BAD if b in line) for line in errors] == BAD
    assert "3 of 43 inputs could not be read" in reference["stderr"]
    assert sorted(p.name for p in reference["dir"].iterdir()) == ["all.npy", "all.npy.inputs.txt", "all.parquet"]


@pytest.mark.parametrize("fmt, seed", [("npy", 1), ("parquet", 2)])
def test_sigkill_then_resume_gives_the_uninterrupted_file(fmt: str, seed: int, reference: dict, checkpoint: Path,
                                                          images: Path, tmp_path: Path) -> None:
    out = tmp_path / f"run.{fmt}"
    inputs = _names(images)
    listing = tmp_path / "inputs.txt"
    listing.write_text("".join(f"{name}\n" for name in inputs), encoding="utf-8")
    line = len('{"input": "", "embedding": ""}\n') + 4 * -(-4 * reference["vectors"].shape[1] // 3)  # base64
    full = sum(line + len(name.encode()) for name in inputs)  # about the whole spool (errors are shorter)
    rng = random.Random(seed)
    # --workers 1: one decoding process reads 3 batches ahead of the records written (PREFETCH + 1),
    # and those wait on the open stdin: 7 of the 11 batches can be written before the kill.
    kill_midway(["embed", "--weights", str(checkpoint), "--image-size", str(IMAGE_SIZE), "--batch-size", "4",
                 "--no-progress", "--output", str(out), "--workers", "1"], spool_path(out), inputs[:-4],
                after_bytes=int(rng.uniform(0.1, 0.5) * full), extra_s=rng.uniform(0, 0.02))
    assert not out.exists()
    found = scan(spool_path(out), kind="embeddings", repair=False)
    assert 0 < found.records < len(inputs)
    done = _embed(checkpoint, "--from-file", str(listing), "--output", str(out), "--resume")
    assert done.returncode == 1, done.stderr  # unreadable inputs, reported in either run
    assert "3 of 43 inputs could not be read" in done.stderr
    assert not spool_path(out).exists()
    if fmt == "npy":
        np.testing.assert_array_equal(np.load(out), reference["vectors"])
        assert (tmp_path / "run.npy.inputs.txt").read_text().splitlines() == reference["inputs"]
    else:
        pq = require_module("pyarrow.parquet")
        assert pq.read_table(out).equals(reference["table"])
    again = _embed(checkpoint, "--from-file", str(listing), "--output", str(out), "--resume")
    assert again.returncode == 0 and "is complete" in again.stderr


def test_output_checks_before_the_model_loads(checkpoint: Path, images: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from convnets.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "done.npy").write_bytes(b"keep")
    (tmp_path / "left.npy.partial.jsonl").write_bytes(b"")
    cases = [(["--output", "x.txt"], "--output x.txt: unknown embedding format '.txt'; end the file name in .npy, "
                                     ".parquet", 2),  # a usage error
             (["--output", "done.npy"], "--output done.npy exists", 1),
             (["--output", "left.npy"], "left.npy.partial.jsonl exists: a stopped run left it; pass --resume", 1)]
    for args, message, status in cases:
        assert main(["embed", "--weights", str(checkpoint), *args, str(images)]) == status
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit):
        main(["embed", str(images)])  # --output is required
    assert "the following arguments are required: --output" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.npy", "left.npy.partial.jsonl"]


def test_resume_with_another_layer_is_refused(reference: dict, checkpoint: Path, images: Path, tmp_path: Path) -> None:
    out = tmp_path / "e.npy"
    write_spool(spool_path(out), [{"input": _names(images)[0], "embedding": reference["vectors"][0]}])
    before = spool_path(out).read_bytes()
    done = _embed(checkpoint, str(images), "--output", str(out), "--resume", "--layer", "layer3")
    assert done.returncode == 1 and "resume with the same --layer and model" in done.stderr
    assert spool_path(out).read_bytes() == before and not out.exists()


# Before, the spool was binary frames with a CRC each (damage: a checksum mismatch); now it is JSON
# lines (damage: a whole line that is not a record), and the vectors come back bit for bit.
def test_spool_torn_tail_is_cut_and_damage_refused(tmp_path: Path) -> None:
    spool = tmp_path / "s.parquet.partial.jsonl"
    records = [{"input": f"a{i}.jpg", "embedding": np.arange(6, dtype=np.float32) / 7 + i} for i in range(5)]
    records.insert(2, {"input": "bad.jpg", "error": "Cannot load image 'bad.jpg'"})
    write_spool(spool, records)
    whole = spool.read_bytes()
    back = list(read_spool(spool, "embeddings"))
    assert [r["input"] for r in back] == [r["input"] for r in records] and back[2] == records[2]
    assert all(np.array_equal(a["embedding"], b["embedding"]) for a, b in zip(back, records) if "embedding" in a)
    spool.write_bytes(whole[:-10])  # a killed writer's partial last line
    found = scan(spool, kind="embeddings")
    assert (found.records, found.errors, found.width) == (5, 1, 6) and found.torn > 0
    assert spool.stat().st_size == found.end
    damaged = whole.replace(b'"a0.jpg", "embedding": "', b'"a0.jpg", "embedding": "%')  # not base64
    spool.write_bytes(damaged)
    with pytest.raises(InvalidArgumentError, match="damaged"):
        scan(spool, kind="embeddings")
    assert spool.read_bytes() == damaged  # refused, not cut


def test_embed_is_exported_once() -> None:
    assert json.dumps(convnets.__all__).count('"embed"') == 1 and callable(convnets.embed)
