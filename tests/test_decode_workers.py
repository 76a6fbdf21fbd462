"""Decoding in worker processes (``predict --workers N``, :mod:`convnets.inference.loader`): the same tensors,
records and order as decoding in-process, errors in place, inputs still read lazily."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Route, cli_in_process, run_cli
from PIL import Image

import convnets
from convnets.errors import ImageDecodeError, ImageDownloadError, InvalidArgumentError
from convnets.inference.loader import PREFETCH, iter_batches
from convnets.inference.predict import iter_inputs, predict_items
from convnets.preprocessing.presets import EvalPreset

TINY_ARCH = {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}
PRESET = EvalPreset.for_image_size(32)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JPEGs and PNGs of several sizes and modes, with a truncated, a corrupt and a non-image file among them."""
    root = tmp_path_factory.mktemp("decode")
    rng = np.random.default_rng(0)
    for i in range(23):
        shape = (30 + i, 50 - i, 3)
        image = Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8))
        if i % 4 == 1:
            image = image.convert("L")  # converted to RGB by the pipeline, in whichever process decodes
        image.save(root / f"img{i:03d}.{'jpg' if i % 2 else 'png'}")
    good = (root / "img004.png").read_bytes()
    (root / "img005b.png").write_bytes(good[: len(good) // 3])  # truncated, between good ones
    (root / "img010b.jpg").write_bytes(b"\xff\xd8\xff" + bytes(100))
    (root / "img020b.jpg").write_text("not an image")
    return root


def _batches(images: Path, workers: int, batch_size: int = 4, start: int = 0) -> list:
    return list(iter_batches(iter_inputs([str(images)]), batch_size=batch_size, preset=PRESET, timeout=5,
                             workers=workers, start=start))


@pytest.mark.parametrize("start", [0, 3])
def test_workers_give_the_same_batches_bit_for_bit(images: Path, start: int) -> None:
    inline, parallel = _batches(images, 0, start=start), _batches(images, 2, start=start)
    assert [len(b.items) for b in parallel] == [len(b.items) for b in inline]
    assert len(inline[0].items) == 4 - start % 4  # the batch boundary rule of a resumed run
    for a, b in zip(inline, parallel, strict=True):
        assert a.items == b.items and a.rows == b.rows
        assert torch.equal(a.tensor, b.tensor) and a.tensor.dtype == b.tensor.dtype == torch.float32
        assert {i: (type(e), str(e)) for i, e in a.errors.items()} == {i: (type(e), str(e)) for i, e in b.errors.items()}
    failed = [b.items[i][0] for b in parallel for i in b.errors]
    assert [Path(name).name for name in failed] == ["img005b.png", "img010b.jpg", "img020b.jpg"]
    assert all(isinstance(e, ImageDecodeError) for b in parallel for e in b.errors.values())


def test_predict_records_are_identical_with_workers(images: Path, tmp_path: Path) -> None:
    """Whole runs: the --jsonl stream with 2 decoding processes is byte for byte the in-process one."""
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", **TINY_ARCH)
    checkpoint = tmp_path / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, checkpoint)
    args = ["--weights", str(checkpoint), "--image-size", "32", "--batch-size", "4", "--topk", "2", "--no-progress",
            "--jsonl", str(images)]
    # The decoding processes in a real process of their own; the reference needs none (in this process).
    inline, parallel = cli_in_process("predict", *args, "--workers", "0"), run_cli("predict", *args, "--workers", "2")
    assert inline.returncode == parallel.returncode == 1, parallel.stderr
    assert parallel.stdout == inline.stdout and len(inline.stdout.splitlines()) == 26
    errors = [line for line in parallel.stderr.splitlines() if "error:" in line]
    assert errors == [line for line in inline.stderr.splitlines() if "error:" in line] and len(errors) == 3


def test_workers_read_inputs_lazily(images: Path) -> None:
    """The main process reads the inputs a few batches ahead of the model, no more (memory stays flat)."""
    names = [name for name, _ in iter_inputs([str(images)])]
    pulled: list[str] = []

    def lazily() -> Iterator[tuple[str, None]]:
        for name in names:
            pulled.append(name)
            yield name, None
    workers, batch_size = 2, 3
    batches = iter_batches(lazily(), batch_size=batch_size, preset=PRESET, timeout=5, workers=workers)
    first = next(batches)
    assert [name for name, _ in first.items] == names[:3]
    ahead = (PREFETCH * workers + 1) * batch_size  # DataLoader's prefetch, plus the batch it replaces
    assert batch_size < len(pulled) <= ahead < len(names)
    assert [name for b in batches for name, _ in b.items] == names[3:]


def test_urls_keep_their_timeout_and_order_in_workers(images: Path, http_server) -> None:
    """A URL that answers too late fails with its timeout error, in its place, while files around it decode."""
    http_server.routes["/slow.jpg"] = Route((images / "img001.jpg").read_bytes(), content_type="image/jpeg",
                                            delay_s=3)
    http_server.routes["/ok.jpg"] = Route((images / "img003.jpg").read_bytes(), content_type="image/jpeg")
    files = [str(images / "img000.png"), str(images / "img002.png")]
    inputs = [files[0], f"{http_server.base_url}/slow.jpg", f"{http_server.base_url}/ok.jpg", files[1]]
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", **TINY_ARCH).eval()
    results = list(predict_items(model, ((name, None) for name in inputs), batch_size=2, preset=PRESET, timeout=1,
                                 workers=2, allow_private=True))
    assert [r.input for r in results] == inputs
    assert [r.ok for r in results] == [True, False, True, True]
    assert isinstance(results[1].error, ImageDownloadError) and "1" in str(results[1].error)
    assert results[1].error.keyword == "timeout"  # the command line adds its --timeout advice from this


def test_bad_worker_counts_are_refused(images: Path, capsys: pytest.CaptureFixture) -> None:
    from convnets.cli import main

    with pytest.raises(InvalidArgumentError, match=r"workers=-1: the number of decoding processes"):
        next(predict_items(lambda x: x, iter([]), labels=["a"], workers=-1))
    with pytest.raises(SystemExit) as usage:
        main(["predict", "--workers", "-1", str(images)])
    assert usage.value.code == 2 and "--workers: must be a non-negative integer, got '-1'" in capsys.readouterr().err


def test_thousands_of_images_in_a_tree_each_recorded_once_in_order(tmp_path: Path) -> None:
    """Scale: 2,000 small generated images in a tree, with corrupt, truncated, non-image and hidden
    files among them, through two decoding processes: one record per listed image, in the walk's
    sorted order (listed independently here with os.walk), errors exactly for the bad files."""
    import json
    import os

    rng = np.random.default_rng(3)
    root = tmp_path / "tree"
    for i in range(2_000):
        folder = root / f"d{i % 7}" / f"e{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
    good = (root / "d0" / "e0" / "0000.png").read_bytes()
    bad = {root / "d1" / "corrupt.jpg": b"\xff\xd8\xff" + bytes(50), root / "d2" / "e1" / "cut.png": good[:30],
           root / "d3" / "text.png": b"not an image at all"}
    for path, data in bad.items():
        path.write_bytes(data)
    (root / "d4" / ".hidden.png").write_bytes(good)  # never listed
    (root / "d5" / "._resource.png").write_bytes(b"macOS resource fork")
    (root / ".hiddendir").mkdir()
    (root / ".hiddendir" / "x.png").write_bytes(good)
    expected = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        expected += [os.path.join(folder, f) for f in sorted(files) if not f.startswith(".")]
    # os.walk lists a folder's files before its subfolders; the walk sorts them together by name.
    expected.sort(key=lambda p: Path(p).relative_to(root).parts)
    ckpt = tmp_path / "tiny.pth.tar"
    model = convnets.get_model("resnet50", **TINY_ARCH)
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, ckpt)
    out = tmp_path / "out.jsonl"
    proc = run_cli("predict", "--weights", str(ckpt), "--image-size", "16", "--batch-size", "64", "--topk", "1",
                   "--workers", "2", "--recursive", str(root), "--output", str(out), "--no-progress")
    assert proc.returncode == 1, proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input"] for r in records] == expected and len(records) == 2_003
    assert {r["input"] for r in records if "error" in r} == {str(p) for p in bad}
    assert "3 of 2003 inputs could not be read" in proc.stderr


@pytest.mark.parametrize("options, message", [
    (dict(batch_size=0), "batch_size must be a positive integer, got 0"),
    (dict(batch_size=2, start=-1), "start must be a non-negative integer, got -1"),
    (dict(batch_size=2, workers=-1), "workers"),
])
def test_batching_options_are_checked_once_for_predict_and_embed(images: Path, options: dict, message: str) -> None:
    """The batching mechanism (convnets.inference.loader.iter_batches) checks its options for every caller."""
    from convnets.inference.embed import embed_items

    model = convnets.get_model("resnet50", **TINY_ARCH).eval()
    preset = EvalPreset.for_image_size(32)
    items = list(iter_inputs(str(images)))  # one path alone: not an iterable of its characters
    assert len(items) > 1 and all(error is None for _, error in items[:1])
    calls = [lambda: iter_batches(items, preset=preset, timeout=5, **options),
             lambda: predict_items(model, items, preset=preset, **options),
             lambda: embed_items(model, items, preset=preset, **options)]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=message):
            next(iter(call()))
