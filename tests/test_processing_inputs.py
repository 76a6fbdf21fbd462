"""Every accepted input kind and option of prepare_input_from_uri / prepare_batch.

Expected values are torchvision's upstream ``Compose`` on the image opened with Pillow directly.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from processing_support import (  # noqa: F401
    MEAN,
    STD,
    encode,
    http_server,
    photo,
    reference,
    small_png,
)
from torchvision import transforms

import processing_utils
from processing_utils import (
    ImageDecodeError,
    ImageDownloadError,
    ImageNotFoundError,
    PreparedBatch,
    prepare_batch,
    prepare_input_from_uri,
)

# preprocess_image is documented (README) as bit-identical to torchvision's upstream Compose, so
# results are compared exactly (rtol=0, atol=0 is torch.equal plus dtype/shape checks).
TOL = 0


@pytest.fixture(scope="module")
def cat_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's image (a 300x200 real photo) as a local file."""
    path = tmp_path_factory.mktemp("images") / "cat.png"
    path.write_bytes(small_png())
    return path


def _expected(data: bytes) -> torch.Tensor:
    return reference(Image.open(io.BytesIO(data)).convert("RGB")).unsqueeze(0)


def test_every_single_input_kind(cat_path: Path, http_server: str) -> None:
    data = cat_path.read_bytes()
    expected = _expected(data)
    for source in (str(cat_path), cat_path, data, bytearray(data), Image.open(cat_path),
                   f"{http_server}/image.png", f"{http_server}/image.bin",
                   f"{http_server}/image.png?raw&size=large"):
        result = prepare_input_from_uri(source, allow_private=True)  # the server is on loopback
        assert result.shape == (1, 3, 224, 224), type(source)
        torch.testing.assert_close(result, expected, rtol=0, atol=TOL)


def test_mixed_list_is_one_batch_in_input_order(cat_path: Path, http_server: str) -> None:
    rocket, coffee = photo("rocket.jpg"), photo("coffee.png")
    camera = Image.open(photo("camera.png"))
    inputs = [str(rocket), f"{http_server}/image.png", coffee.read_bytes(), camera, cat_path]
    expected = torch.stack([
        reference(Image.open(rocket).convert("RGB")),
        _expected(small_png())[0],
        reference(Image.open(coffee).convert("RGB")),
        reference(camera.convert("RGB")),
        _expected(cat_path.read_bytes())[0],
    ])
    batch = prepare_input_from_uri(inputs, allow_private=True)
    assert batch.shape == (5, 3, 224, 224)
    assert batch.is_contiguous()
    torch.testing.assert_close(batch, expected, rtol=0, atol=TOL)
    # A tuple and the one-at-a-time upstream idiom give the same batch.
    torch.testing.assert_close(prepare_input_from_uri(tuple(inputs), allow_private=True), batch, rtol=0, atol=0)
    singles = torch.cat([prepare_input_from_uri(x, allow_private=True) for x in inputs])
    torch.testing.assert_close(singles, batch, rtol=0, atol=0)


def test_workers_do_not_change_the_result(cat_path: Path) -> None:
    inputs = [photo("rocket.jpg"), cat_path, photo("coffee.png")] * 2
    serial = prepare_input_from_uri(inputs, workers=1)
    torch.testing.assert_close(prepare_input_from_uri(inputs, workers=3), serial, rtol=0, atol=0)


def test_list_is_loaded_concurrently(http_server: str) -> None:
    # The server answers these four only once all four wait at once: fetched one after the other, the first would
    # wait alone until the server gave up on it (504), or the client's timeout.
    urls = [f"{http_server}/together/concurrently/4/{i}.png" for i in range(4)]
    batch = prepare_input_from_uri(urls, allow_private=True, timeout=60)
    assert batch.shape == (4, 3, 224, 224)


def test_empty_list() -> None:
    assert prepare_input_from_uri([]).shape == (0, 3, 224, 224)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype(cat_path: Path, dtype: torch.dtype) -> None:
    expected = _expected(cat_path.read_bytes()).to(dtype)
    result = prepare_input_from_uri(cat_path, dtype=dtype)
    assert result.dtype == dtype
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_channels_last(cat_path: Path) -> None:
    result = prepare_input_from_uri([cat_path, cat_path], memory_format=torch.channels_last)
    assert result.is_contiguous(memory_format=torch.channels_last)
    assert not result.is_contiguous()
    expected = _expected(cat_path.read_bytes()).expand(2, -1, -1, -1)
    torch.testing.assert_close(result, expected, rtol=0, atol=TOL)


def test_device_options(cat_path: Path) -> None:
    for options in ({"device": "cpu"}, {"device": torch.device("cpu")}, {"cuda": False}):
        assert prepare_input_from_uri(cat_path, **options).device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_clear_error(cat_path: Path) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        prepare_input_from_uri(cat_path, cuda=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_like_upstream(cat_path: Path) -> None:
    result = prepare_input_from_uri(cat_path, cuda=True)
    assert result.is_cuda
    torch.testing.assert_close(result.cpu(), _expected(cat_path.read_bytes()), rtol=0, atol=TOL)
    assert prepare_input_from_uri(cat_path, cuda=True, device="cpu").device.type == "cpu"


def test_image_and_resize_size(cat_path: Path) -> None:
    compose = transforms.Compose([transforms.Resize(160), transforms.CenterCrop(128),
                                  transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    expected = compose(Image.open(cat_path).convert("RGB")).unsqueeze(0)
    result = prepare_input_from_uri(cat_path, image_size=128, resize_size=160)
    assert result.shape == (1, 3, 128, 128)
    torch.testing.assert_close(result, expected, rtol=0, atol=TOL)


@pytest.mark.parametrize(("options", "error", "text"), [
    ({"image_size": 0}, ValueError, "image_size"),
    ({"image_size": 224.0}, ValueError, "image_size"),
    ({"resize_size": -1}, ValueError, "resize_size"),
    ({"image_size": 300}, ValueError, "larger than resize_size"),
    ({"timeout": 0}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
    ({"timeout": "30"}, ValueError, "timeout"),
    ({"max_bytes": 0}, ValueError, "max_bytes"),
    ({"max_pixels": -5}, ValueError, "max_pixels"),
    ({"workers": 0}, ValueError, "workers"),
    ({"workers": True}, ValueError, "workers"),
    ({"dtype": torch.int64}, ValueError, "floating-point"),
    ({"dtype": "float32"}, ValueError, "dtype"),
    ({"memory_format": torch.channels_last_3d}, ValueError, "memory_format"),
    ({"device": "no-such-device"}, ValueError, "no-such-device"),
    ({"cuda": "yes"}, TypeError, "cuda"),
])
def test_invalid_options(cat_path: Path, options: dict[str, object], error: type[Exception],
                         text: str) -> None:
    with pytest.raises(error, match=text):
        prepare_input_from_uri(cat_path, **options)
    with pytest.raises(error, match=text):
        prepare_input_from_uri([cat_path], **options)


def test_prepare_batch_collects_failures(cat_path: Path, tmp_path: Path, http_server: str) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    inputs = [cat_path, tmp_path / "missing.jpg", photo("rocket.jpg"), str(text),
              f"{http_server}/missing.jpg"]
    result = prepare_batch(inputs, on_error="collect", allow_private=True)
    assert isinstance(result, PreparedBatch)
    assert result.indices == [0, 2]
    assert [(i, type(e)) for i, e in result.errors] == [
        (1, ImageNotFoundError), (3, ImageDecodeError), (4, ImageDownloadError)]
    assert "missing.jpg" in str(result.errors[0][1])
    expected = torch.stack([reference(Image.open(inputs[i]).convert("RGB")) for i in (0, 2)])
    torch.testing.assert_close(result.tensor, expected, rtol=0, atol=TOL)


def test_prepare_batch_all_failed(tmp_path: Path) -> None:
    tensor, indices, errors = prepare_batch([tmp_path / "a.jpg", b"junk"], on_error="collect")
    assert tensor.shape == (0, 3, 224, 224)
    assert indices == [] and [i for i, _ in errors] == [0, 1]


def test_raise_mode_raises_first_failure_in_input_order(cat_path: Path, tmp_path: Path) -> None:
    inputs = [cat_path, b"junk", tmp_path / "missing.jpg"]
    with pytest.raises(ImageDecodeError, match="4 bytes"):
        prepare_batch(inputs, workers=3)
    with pytest.raises(ImageDecodeError, match="4 bytes"):
        prepare_input_from_uri(inputs, workers=3)


def test_prepare_batch_argument_errors(cat_path: Path) -> None:
    with pytest.raises(ValueError, match="on_error"):
        prepare_batch([cat_path], on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list or tuple"):
        prepare_batch(str(cat_path))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="input 1 has type int"):
        prepare_batch([cat_path, 3])  # type: ignore[list-item]


def test_hub_style_utils_object(cat_path: Path) -> None:
    utils = processing_utils.get_utils()
    for name in ("prepare_input_from_uri", "pick_n_best", "get_imgnet_classes",
                 "get_imgnet_synsets", "prepare_batch", "load_image"):
        assert callable(getattr(utils, name)), name
    torch.testing.assert_close(utils.prepare_input_from_uri(str(cat_path)),
                               _expected(cat_path.read_bytes()), rtol=0, atol=TOL)
