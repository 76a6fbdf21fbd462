"""Real photos in every image mode give the upstream numbers after EXIF and RGB normalisation.

The expected values come from torchvision's upstream ``Compose`` applied to an RGB image that the
test makes with Pillow directly (``convert('RGB')``, an explicit rotation, an explicit 1/257
scaling), never from processing_utils.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from processing_support import encode, photo, reference

from processing_utils import preprocess_image, prepare_input_from_uri

# preprocess_image is documented (README) as bit-identical to torchvision's upstream Compose, so
# results are compared exactly (rtol=0, atol=0 is torch.equal plus dtype/shape checks).
TOL = 0


def _open(name: str) -> Image.Image:
    with Image.open(photo(name)) as img:
        img.load()
        return img


def _check(data: bytes, expected_rgb: Image.Image) -> torch.Tensor:
    result = prepare_input_from_uri(data)
    expected = reference(expected_rgb).unsqueeze(0)
    assert result.shape == (1, 3, 224, 224)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected, rtol=0, atol=TOL)
    return result


@pytest.mark.parametrize("name", ["chelsea.png", "coffee.png", "rocket.jpg", "china.jpg",
                                  "flower.jpg", "astronaut.png"])
def test_rgb_photos_match_upstream_pipeline(name: str) -> None:
    path = photo(name)
    with Image.open(path) as img:
        expected = reference(img.convert("RGB")).unsqueeze(0)
    torch.testing.assert_close(prepare_input_from_uri(str(path)), expected, rtol=0, atol=TOL)


def test_grayscale_L_photo() -> None:
    camera = _open("camera.png")
    assert camera.mode == "L"
    _check(encode(camera, "PNG"), camera.convert("RGB"))


def test_LA_photo_drops_alpha() -> None:
    camera = _open("camera.png")
    la = Image.merge("LA", (camera, camera.point(lambda v: 255 - v)))
    _check(encode(la, "PNG"), camera.convert("RGB"))


@pytest.mark.filterwarnings("error")  # palette transparency must not warn
@pytest.mark.parametrize("transparency", [None, "index", "bytes"])
def test_palette_photo(transparency: str | None) -> None:
    cat = _open("chelsea.png").quantize(64)
    params: dict[str, object] = {}
    if transparency == "index":
        params["transparency"] = 3
    elif transparency == "bytes":
        params["transparency"] = bytes(range(0, 256, 4))
    data = encode(cat, "PNG", **params)
    reopened = Image.open(io.BytesIO(data))
    assert reopened.mode == "P"
    assert ("transparency" in reopened.info) == (transparency is not None)
    # The colours of the palette entries, alpha ignored: what convert('RGB') means for P.
    palette = np.array(cat.getpalette(), dtype=np.uint8).reshape(-1, 3)
    expected = Image.fromarray(palette[np.asarray(cat)])
    _check(data, expected)


def test_RGBA_logo_drops_alpha_like_convert_rgb() -> None:
    logo = _open("logo.png")
    assert logo.mode == "RGBA"
    expected = Image.fromarray(np.asarray(logo)[:, :, :3].copy())
    _check(encode(logo, "PNG"), expected)


def test_CMYK_jpeg() -> None:
    data = encode(_open("chelsea.png").convert("CMYK"), "JPEG", quality=95)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.mode == "CMYK"
    _check(data, decoded.convert("RGB"))


def test_one_bit_image() -> None:
    bits = _open("camera.png").convert("1")
    _check(encode(bits, "PNG"), bits.convert("RGB"))


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16_bit_gray_is_scaled_not_clipped(fmt: str) -> None:
    gray = _open("camera.png")
    wide = Image.fromarray(np.asarray(gray).astype(np.uint16) * 257)
    data = encode(wide, fmt)
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    # v * 257 / 257 == v: the 16-bit file must give exactly the 8-bit photo's numbers.
    result = _check(data, gray.convert("RGB"))
    clipped = reference(Image.open(io.BytesIO(data)).convert("RGB")).unsqueeze(0)
    assert (result - clipped).abs().max() > 1  # what Pillow's clipping convert would give


def test_16_bit_scaling_rounds_to_nearest() -> None:
    values = np.array([[0, 128, 129, 385, 386, 65535, 65407, 32896]], dtype=np.uint16)
    wide = Image.fromarray(np.repeat(np.repeat(values, 64, axis=0), 64, axis=1))
    expected_8bit = np.rint(values.astype(np.float64) / 257).astype(np.uint8)
    assert expected_8bit.tolist() == [[0, 0, 1, 1, 2, 255, 255, 128]]
    gray = Image.fromarray(np.repeat(np.repeat(expected_8bit, 64, axis=0), 64, axis=1))
    _check(encode(wide, "PNG"), gray.convert("RGB"))


def test_float_image_uses_pillow_convert() -> None:
    gray = _open("camera.png").convert("F")
    _check(encode(gray, "TIFF"), gray.convert("RGB"))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied(orientation: int) -> None:
    rocket = _open("rocket.jpg")
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(rocket, "JPEG", quality=95, exif=exif)
    stored = Image.open(io.BytesIO(data)).convert("RGB")  # pixels as stored, before rotation
    rotation = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_270,
                8: Image.Transpose.ROTATE_90}[orientation]
    result = _check(data, stored.transpose(rotation))
    unrotated = reference(stored).unsqueeze(0)
    assert (result - unrotated).abs().max() > 1  # the test would notice a missing rotation


def test_pil_input_is_not_modified() -> None:
    rocket = _open("rocket.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    img = Image.open(io.BytesIO(encode(rocket.convert("L"), "JPEG", exif=exif)))
    before = (img.mode, img.size, np.asarray(img).copy())
    prepare_input_from_uri(img)
    assert (img.mode, img.size) == before[:2]
    assert np.array_equal(np.asarray(img), before[2])
    assert img.getexif()[0x0112] == 6


def test_preprocess_image_refuses_non_rgb() -> None:
    with pytest.raises(ValueError, match="mode 'L'"):
        preprocess_image(_open("camera.png"))
