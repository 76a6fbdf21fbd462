"""``fast_decode`` / ``--fast-decode``: large JPEGs decoded at a reduced DCT scale, everything else exact.

The exact path is compared bitwise with torchvision's upstream ``Compose`` (tests/processing_support's
``reference``), never with the code under test; the fast path with the exact one, within a bound in
normalised units (1 uint8 level is about 0.017). No timings here: benchmarks/bench_fast_decode.py
measures the speed.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, cli_in_process
from PIL import Image
from processing_support import reference

import convnets
from convnets.data.folders import eval_loader, to_device
from convnets.dist import DistContext
from convnets.inference.loader import Decoding, decode
from convnets.preprocessing.decode import FAST_DECODE_MARGIN, fast_decode_draft, load_image
from convnets.preprocessing.pipeline import prepare_batch
from convnets.preprocessing.presets import DEFAULT_PRESET

SE = "se_resnext101_32x4d"
# The bounds the fast path must keep on a photo-like JPEG (measured: mean 0.005, max 0.07 at 12 MP).
MEAN_BOUND, MAX_BOUND = 0.02, 0.25


def _photo(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A photo-like RGB image: an example photo upscaled, with mid-frequency texture and grain."""
    rng = np.random.default_rng(seed)
    base = Image.open(REPO / "examples" / "rocket.jpg").convert("RGB").resize(size, Image.BICUBIC)
    low = np.clip(rng.normal(128, 40, (size[1] // 8, size[0] // 8, 3)), 0, 255).astype(np.uint8)
    texture = np.asarray(Image.fromarray(low).resize(size, Image.BICUBIC), dtype=np.float32) - 128
    pixels = np.asarray(base, dtype=np.float32) + 0.5 * texture + rng.normal(0, 6, (size[1], size[0], 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _jpeg(image: Image.Image, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **params)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def large_jpeg() -> bytes:
    """2400x1800 (a quarter of a phone photo's side is enough to be drafted to 1/2 for resize 256)."""
    return _jpeg(_photo((2400, 1800)))


@pytest.fixture(scope="module")
def rotated_jpeg() -> bytes:
    """A landscape JPEG whose EXIF says "rotate 90" (orientation 6), as phones save portraits."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _jpeg(_photo((2400, 1600), seed=1), exif=exif.tobytes())


def _exact_upstream(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        from PIL import ImageOps

        return reference(ImageOps.exif_transpose(image).convert("RGB"))


@pytest.mark.parametrize("name", ["large_jpeg", "rotated_jpeg"])
def test_fast_pixels_are_close_to_the_exact_ones(name: str, request: pytest.FixtureRequest) -> None:
    data: bytes = request.getfixturevalue(name)
    exact = prepare_batch([data]).tensor[0]
    fast = prepare_batch([data], fast_decode=True).tensor[0]
    assert torch.equal(exact, _exact_upstream(data))  # the default is still the upstream numbers
    difference = (fast - exact).abs()
    assert 0 < difference.mean().item() < MEAN_BOUND, difference.mean()  # drafted, yet close
    assert difference.max().item() < MAX_BOUND, difference.max()


def test_the_draft_keeps_at_least_the_margin(large_jpeg: bytes) -> None:
    side = fast_decode_draft(DEFAULT_PRESET)
    assert side == FAST_DECODE_MARGIN * DEFAULT_PRESET.resize_size
    drafted = load_image(large_jpeg, draft=side)
    assert drafted.size == (1200, 900)  # 1/2: 1/4 would leave 450 < 512
    assert load_image(large_jpeg).size == (2400, 1800)


@pytest.mark.parametrize("kind", ["small jpeg", "large png", "large webp", "pil image"])
def test_other_images_are_bit_identical_to_the_exact_path(kind: str, tmp_path: Path) -> None:
    if kind == "small jpeg":  # 640x427: not twice the draft size, decoded exactly
        source: object = str(REPO / "examples" / "rocket.jpg")
    elif kind == "pil image":  # already decoded: nothing to draft
        source = _photo((2400, 1800))
    else:
        path = tmp_path / f"large.{kind.split()[1]}"
        _photo((2400, 1800)).save(path)
        source = str(path)
    exact = prepare_batch([source]).tensor  # type: ignore[list-item]
    fast = prepare_batch([source], fast_decode=True).tensor  # type: ignore[list-item]
    assert torch.equal(exact, fast)


def test_decoding_carries_fast_decode_to_the_decoder(large_jpeg: bytes, tmp_path: Path) -> None:
    path = tmp_path / "large.jpg"
    path.write_bytes(large_jpeg)
    items = [(str(path), None)]
    exact = decode(items, Decoding(DEFAULT_PRESET)).tensor
    fast = decode(items, Decoding(DEFAULT_PRESET, fast_decode=True)).tensor
    assert torch.equal(exact, prepare_batch([str(path)]).tensor)
    assert torch.equal(fast, prepare_batch([str(path)], fast_decode=True).tensor)
    assert not torch.equal(exact, fast)


@pytest.mark.parametrize("fast", [False, True])
def test_the_evaluation_loader_sees_the_pixels_predict_sees(fast: bool, large_jpeg: bytes, tmp_path: Path) -> None:
    path = tmp_path / "large.jpg"
    path.write_bytes(large_jpeg)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    images, _, _ = next(iter(eval_loader([(str(path), 0)], DEFAULT_PRESET, batch_size=1, workers=0, ctx=ctx,
                                         fast_decode=fast)))
    loaded = to_device(images, torch.device("cpu"), torch.contiguous_format, DEFAULT_PRESET)
    assert torch.equal(loaded, prepare_batch([str(path)], fast_decode=fast).tensor)


def test_invalid_fast_decode_is_refused() -> None:
    with pytest.raises(TypeError, match="fast_decode must be True or False"):
        prepare_batch([str(REPO / "examples" / "rocket.jpg")], fast_decode="yes")  # type: ignore[arg-type]


# --- the command line ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = convnets.get_model(SE, num_classes=2, **TINY[SE])
    path = tmp_path_factory.mktemp("ckpt") / "two.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                "class_names": ["rocket", "other"]}, path)
    return path


def test_predict_fast_decode_records_every_input(checkpoint: Path, large_jpeg: bytes, rotated_jpeg: bytes,
                                                 tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a_large.jpg").write_bytes(large_jpeg)
    (folder / "b_rotated.jpg").write_bytes(rotated_jpeg)
    (folder / "c_small.png").write_bytes((REPO / "examples" / "coffee.png").read_bytes())
    (folder / "d_broken.jpg").write_bytes(large_jpeg[:2000])
    output = tmp_path / "records.jsonl"
    done = cli_in_process("predict", "--weights", str(checkpoint), "--fast-decode", "--topk", "2", "--batch-size", "3",
                          "--workers", "0", "--no-progress", "--output", str(output), str(folder))
    assert done.returncode == 1, done.stderr[-2000:]  # the broken file
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [Path(r["input"]).name for r in records] == ["a_large.jpg", "b_rotated.jpg", "c_small.png",
                                                        "d_broken.jpg"]
    assert all(len(r["top"]) == 2 for r in records[:3]) and "error" in records[3]


def test_evaluate_fast_decode_reports_it(checkpoint: Path, large_jpeg: bytes, tmp_path: Path) -> None:
    data = tmp_path / "val"
    for name in ("rocket", "other"):
        (data / name).mkdir(parents=True)
        (data / name / "one.jpg").write_bytes(large_jpeg)
    done = cli_in_process("evaluate", "--data", str(data), "--weights", str(checkpoint), "--fast-decode",
                          "--workers", "0", "--no-progress", "--output", str(tmp_path / "report"))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["fast_decode"] is True and report["images"] == 2
