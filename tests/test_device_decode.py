"""``--decode device`` / ``decode="device"`` on CPU tensors: the device path against the Pillow path.

The device path (convnets/preprocessing/device.py) decodes JPEGs with ``torchvision.io.decode_jpeg`` and
resizes them as tensors; here it runs on the CPU (``--device cpu``), the same functions that run on a GPU
(tests/test_cuda.py has the CUDA cases). The expected values are independent: upstream's torchvision
``Compose`` on Pillow images (processing_support.reference), and the ``--decode cpu`` run of the same
command. Every faithfulness test also checks that the device path was taken (a spy on the batched
decoder), so that a fallback to Pillow cannot pass it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, cli_in_process, randomize_bn
from PIL import Image, ImageOps
from processing_support import reference

import convnets
from convnets.errors import InvalidArgumentError
from convnets.evaluation.loop import evaluate_model
from convnets.inference.loader import Decoding, decode, iter_batches
from convnets.preprocessing import device as device_path
from convnets.preprocessing.pipeline import prepare_batch
from convnets.preprocessing.presets import DEFAULT_PRESET, IMAGENET_STD

SE = "se_resnext101_32x4d"
PHOTOS = REPO / "convnets" / "assets" / "examples"
# One uint8 level in normalised units, for the channel with the smallest std: the tensor resize rounds
# as Pillow's does, at most one level apart with bilinear interpolation.
ONE_LEVEL = 1 / 255 / min(IMAGENET_STD) + 1e-6
NAMES = ["rocket", "cat", "cup", "other"]


def jpeg(image: Image.Image, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.convert(params.pop("mode", "RGB")).save(buffer, "JPEG", **{"quality": 92, **params})  # type: ignore[arg-type]
    return buffer.getvalue()


def twelve_megapixels() -> Image.Image:
    """A 4000x3000 image: an example photo upscaled (grain would make the JPEG photo-sized, but costs seconds)."""
    return Image.open(PHOTOS / "rocket.jpg").convert("RGB").resize((4000, 3000), Image.BICUBIC)


def photo_jpegs(folder: Path, *, large: bool = True) -> list[Path]:
    """The package's photos as baseline JPEGs (the two PNGs re-encoded at quality 92), one mirrored, a 12 MP one."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in sorted(PHOTOS.glob("*.*g")):
        path = folder / f"{source.stem}.jpg"
        path.write_bytes(source.read_bytes() if source.suffix == ".jpg" else jpeg(Image.open(source)))
        paths.append(path)
    # The rocket mirrored: two JPEGs of one size, which the device path resizes together.
    paths.append(folder / "rocket_mirrored.jpg")
    paths[-1].write_bytes(jpeg(ImageOps.mirror(Image.open(PHOTOS / "rocket.jpg"))))
    if large:
        paths.append(folder / "large_12mp.jpg")
        paths[-1].write_bytes(jpeg(twelve_megapixels(), quality=90))
    return paths


def fallback_inputs(folder: Path) -> dict[str, bytes]:
    """One input of each kind that must go the Pillow path, and two that neither path reads."""
    rocket = Image.open(PHOTOS / "rocket.jpg").convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90", as phones save portraits
    good = jpeg(rocket)
    return {"b_coffee.png": (PHOTOS / "coffee.png").read_bytes(), "c_cmyk.jpg": jpeg(rocket, mode="CMYK"),
            "d_progressive.jpg": jpeg(rocket, progressive=True), "e_grey.jpg": jpeg(rocket, mode="L"),
            "f_rotated.jpg": jpeg(rocket, exif=exif.tobytes()), "g_truncated.jpg": good[:len(good) // 2],
            "h_text.jpg": b"not an image at all"}


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return photo_jpegs(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return randomize_bn(convnets.get_model(SE, num_classes=len(NAMES), **TINY[SE])).eval()


@pytest.fixture(scope="module")
def checkpoint(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),  # type: ignore[union-attr]
                "class_names": NAMES}, path)
    return path


@pytest.fixture
def decoded_on_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many images each batched call of the device decoder got (a spy: the path was taken)."""
    calls: list[int] = []
    real = device_path.decode_jpegs

    def spy(encoded: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor | None]:
        calls.append(len(encoded))
        return real(encoded, device)
    monkeypatch.setattr(device_path, "decode_jpegs", spy)
    yield calls


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)


def test_the_device_path_is_faithful_to_pillow_on_the_photos_and_12_megapixels(
        photos: list[Path], model: torch.nn.Module, decoded_on_device: list[int]) -> None:
    expected = torch.stack([reference(Image.open(p).convert("RGB")) for p in photos])
    decoding = Decoding(DEFAULT_PRESET, decode="device").for_device("cpu")
    batches = list(iter_batches([(str(p), None) for p in photos], batch_size=len(photos), decoding=decoding))
    assert decoded_on_device == [len(photos)]  # every photo, in one batched call
    got = batches[0].tensor
    assert got.shape == expected.shape and batches[0].rows == list(range(len(photos)))
    difference = (got - expected).abs()
    assert difference.max() <= ONE_LEVEL, difference.amax(dim=(1, 2, 3))
    assert difference.mean() < 0.2 * ONE_LEVEL  # most pixels equal
    with torch.no_grad():
        logits, reference_logits = model(got), model(expected)
    assert cosine(logits, reference_logits).min() >= 0.999
    assert torch.equal(logits.argmax(1), reference_logits.argmax(1))


def test_inputs_the_device_does_not_decode_go_the_pillow_path_per_image_in_one_batch(
        tmp_path: Path, decoded_on_device: list[int]) -> None:
    inputs = {"a_rocket.jpg": (PHOTOS / "rocket.jpg").read_bytes(), **fallback_inputs(tmp_path)}
    items = []
    for name, data in inputs.items():
        (tmp_path / name).write_bytes(data)
        items.append((str(tmp_path / name), None))
    items.append((str(tmp_path / "i_missing.jpg"), None))
    cpu = decode(items, Decoding(DEFAULT_PRESET, decode="cpu"))
    read = decode(items, Decoding(DEFAULT_PRESET, decode="device"))
    assert read.loaded is not None
    # Read as encoded JPEGs (1-D): the baseline colour JPEG and the truncated one (its header is fine).
    assert [Path(items[row][0]).name for row, x in zip(read.rows, read.loaded) if x.dim() == 1] == [
        "a_rocket.jpg", "g_truncated.jpg"]
    (batch,) = iter_batches(items, batch_size=len(items), decoding=Decoding(DEFAULT_PRESET, decode="device"))
    assert decoded_on_device == [2]
    assert batch.rows == cpu.rows == [0, 1, 2, 3, 4, 5]  # the same inputs decoded, in one batch
    assert {row: str(error) for row, error in batch.errors.items()} == {
        row: str(error) for row, error in cpu.errors.items()}  # truncated, text, missing: the same messages
    assert sorted(batch.errors) == [6, 7, 8]
    # The Pillow path's rows are bit for bit the CPU path's; the decoded JPEG within one level.
    assert torch.equal(batch.tensor[1:], cpu.tensor[1:])
    assert (batch.tensor[0] - cpu.tensor[0]).abs().max() <= ONE_LEVEL


def test_a_jpeg_the_decoder_refuses_goes_pillow_and_its_error_is_pillow_s(tmp_path: Path) -> None:
    good = (PHOTOS / "rocket.jpg").read_bytes()
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(good[:len(good) // 2])
    loaded = [device_path.load_for_device(p, DEFAULT_PRESET) for p in (str(PHOTOS / "rocket.jpg"), str(broken))]
    assert [x.dim() for x in loaded] == [1, 1]
    crops = device_path.crops_on_device(loaded, [str(PHOTOS / "rocket.jpg"), str(broken)], DEFAULT_PRESET, "cpu")
    (cpu_error,) = prepare_batch([str(broken)], on_error="collect").errors
    assert isinstance(crops[0], torch.Tensor) and crops[0].shape == (3, 224, 224)
    assert str(crops[1]) == str(cpu_error[1]) and "corrupt or truncated" in str(crops[1])


def _records(path: Path) -> dict[str, dict]:
    return {Path(r["input"]).name: r for r in map(json.loads, path.read_text().splitlines())}


def test_predict_decode_device_on_the_cpu_agrees_with_decode_cpu(checkpoint: Path, photos: list[Path], tmp_path: Path,
                                                                  decoded_on_device: list[int]) -> None:
    folder = tmp_path / "inputs"
    folder.mkdir()
    for path in photos[:3]:  # the 12 MP one is the first test's
        (folder / path.name).write_bytes(path.read_bytes())
    for name, data in fallback_inputs(folder).items():
        (folder / name).write_bytes(data)
    runs = {}
    for mode in ("cpu", "device"):
        output = tmp_path / f"{mode}.jsonl"
        done = cli_in_process("predict", "--weights", str(checkpoint), "--decode", mode, "--device", "cpu",
                              "--engine", "torch", "--topk", "4", "--batch-size", "16", "--workers", "0", "--no-progress",
                              "--output", str(output), str(folder))
        assert done.returncode == 1, done.stderr[-2000:]  # the truncated and the text file
        runs[mode] = _records(output)
    assert decoded_on_device == [4]  # the three baseline JPEGs and the truncated one, at once
    cpu, device = runs["cpu"], runs["device"]
    assert list(cpu) == list(device) and len(cpu) == 3 + 7
    for name in cpu:
        if "error" in cpu[name]:
            assert device[name]["error"] == cpu[name]["error"]
            continue
        assert device[name]["top"][0]["index"] == cpu[name]["top"][0]["index"], name
        got = {t["index"]: t["probability"] for t in device[name]["top"]}
        np.testing.assert_allclose([got[t["index"]] for t in cpu[name]["top"]],
                                   [t["probability"] for t in cpu[name]["top"]], atol=2e-3)
    assert sorted(n for n in cpu if "error" in cpu[n]) == ["g_truncated.jpg", "h_text.jpg"]


def test_evaluate_and_embed_take_the_device_path(checkpoint: Path, model: torch.nn.Module, photos: list[Path],
                                                 tmp_path: Path, decoded_on_device: list[int]) -> None:
    data = tmp_path / "val"
    for name, path in zip(NAMES, photos[:3]):
        (data / name).mkdir(parents=True)
        (data / name / path.name).write_bytes(path.read_bytes())
    (data / NAMES[3]).mkdir()
    (data / NAMES[3] / "coffee.png").write_bytes((PHOTOS / "coffee.png").read_bytes())
    (data / NAMES[3] / "broken.jpg").write_bytes(photos[0].read_bytes()[:3000])
    cpu = evaluate_model(model, data, workers=0, device="cpu", decode="cpu")
    device = evaluate_model(model, data, workers=0, device="cpu", decode="device")
    assert decoded_on_device == [4]  # three photos and the broken JPEG, one batch
    assert device.source["decode"] == "device" and cpu.source["decode"] == "cpu"
    assert (device.images, device.unreadable, device.top1, device.top5) == (cpu.images, cpu.unreadable, cpu.top1,
                                                                             cpu.top5) == (4, 1, cpu.top1, cpu.top5)
    assert device.loss == pytest.approx(cpu.loss, rel=1e-2)
    done = cli_in_process("evaluate", "--data", str(data), "--weights", str(checkpoint), "--decode", "device",
                          "--workers", "0", "--device", "cpu", "--engine", "torch", "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    assert decoded_on_device == [4, 4] and f"top-1 {cpu.top1:.2f}%" in done.stdout
    paths = [str(p) for p in photos[:3]]
    on_device = np.stack([v for _, v in convnets.embed(model, paths, decode="device", batch_size=3)])  # type: ignore[arg-type]
    assert decoded_on_device == [4, 4, 3]
    with_pillow = np.stack([v for _, v in convnets.embed(model, paths, decode="cpu", batch_size=3)])  # type: ignore[arg-type]
    assert cosine(torch.from_numpy(on_device), torch.from_numpy(with_pillow)).min() >= 0.999


def test_decode_choices_and_auto() -> None:
    assert device_path.resolve_decode("auto", "cpu") == "cpu"
    assert device_path.resolve_decode("auto", torch.device("cuda", 1)) == "device"
    assert device_path.resolve_decode("device", "cpu") == "device"
    assert Decoding(decode="auto").for_device("cpu").decode == "cpu"
    with pytest.raises(InvalidArgumentError, match="decode must be one of auto, cpu, device, got 'gpu'"):
        Decoding(decode="gpu")
    with pytest.raises(InvalidArgumentError, match="decode must be one of"):
        list(convnets.predict(torch.nn.Identity(), [str(PHOTOS / "rocket.jpg")], labels=["x"], decode="nvjpeg"))
    done = cli_in_process("predict", "--decode", "gpu", str(PHOTOS / "rocket.jpg"))
    assert done.returncode == 2 and "--decode: invalid choice: 'gpu'" in done.stderr


def test_the_served_model_decodes_on_the_device_path_as_on_the_cpu(checkpoint: Path, photos: list[Path],
                                                                     decoded_on_device: list[int]) -> None:
    from convnets.serve.backend import Classifier
    from convnets.serve.repository import ServedModel

    images = [p.read_bytes() for p in photos[:3]] + [(PHOTOS / "coffee.png").read_bytes(), b"not an image"]
    decoded = {}
    for mode in ("cpu", "device"):
        served = ServedModel(name="tiny", model="tiny", weights=str(checkpoint), pretrained=False, image_size=224,
                             engine="torch", precision="fp32", device="cpu", topk=3, threads=2, max_batch_size=8,
                             max_queue_delay_us=0, max_image_bytes=2**20, labels=tuple(NAMES), num_features=0,
                             decode=mode)
        decoded[mode] = Classifier(served).decode(images)
    assert decoded_on_device == [3]
    cpu, device = decoded["cpu"], decoded["device"]
    assert device.rows == cpu.rows == {0: 0, 1: 1, 2: 2, 3: 3} and device.errors == cpu.errors and 4 in cpu.errors
    assert torch.equal(device.tensor[3], cpu.tensor[3])  # the PNG: Pillow's path
    assert (device.tensor - cpu.tensor).abs().max() <= ONE_LEVEL
