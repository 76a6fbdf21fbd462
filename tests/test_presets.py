"""Evaluation presets: one description of resize / crop / interpolation / mean / std, owned by the
weights, from which every eval path takes its numbers.

The expected tensors come from torchvision's ``transforms.Compose`` built from the raw numbers
(the manifest's JSON, or literals), never from ``convnets.preprocessing``.

Which paths are bit-identical (asserted with ``torch.equal``):

* ``prepare_batch`` / ``prepare_input_from_uri`` / ``predict`` with a preset and torchvision's
  PIL ``Compose([Resize, CenterCrop, ToTensor, Normalize])`` with the same numbers;
* the ``pytorch`` validation loader (``val_transform`` + ``to_device``) and ``prepare_batch`` on
  the same files: both decode with ``load_image``, resize and crop with PIL, and normalise with
  the same float32 operations in the same order.

DALI decodes and resamples with its own kernels; ``tests/test_train_dali.py`` checks that its
validation crops correlate (> 0.9) with the ``pytorch`` backend's, not that they are equal.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

from convnets.dist import DistContext
from convnets.errors import InvalidArgumentError, ManifestError
from convnets.inference.predict import predict
from convnets.preprocessing.decode import load_image
from convnets.preprocessing.pipeline import prepare_batch, prepare_input_from_uri
from convnets.preprocessing.presets import DEFAULT_PRESET, EvalPreset, preset_for_model
from convnets.registry import _apply_metadata
from convnets.data.folders import make_data, to_device, val_transform
from convnets.data.scan import scan_split
from convnets.weights.record import ModelRecord
from convnets.weights.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (REPO / "examples").iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
CPU = torch.device("cpu")
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def compose(crop: int, resize: int, interpolation: str = "bilinear", mean: tuple = MEAN,
            std: tuple = STD) -> transforms.Compose:
    """torchvision's upstream evaluation transform with explicit numbers."""
    return transforms.Compose([
        transforms.Resize(resize, interpolation=transforms.InterpolationMode(interpolation), antialias=True),
        transforms.CenterCrop(crop),
        transforms.ToTensor(),
        transforms.Normalize(mean=list(mean), std=list(std)),
    ])


# ---- the preset itself --------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "resize"), [(224, 256), (160, 183), (128, 146), (32, 37), (288, 329),
                                              (1, 1)])
def test_for_image_size(size: int, resize: int) -> None:
    # Literal expectations (round(size * 256 / 224)), not the formula again.
    preset = EvalPreset.for_image_size(size)
    assert (preset.crop_size, preset.resize_size) == (size, resize)
    assert (preset.interpolation, preset.mean, preset.std) == ("bilinear", MEAN, STD)


def test_default_preset_is_upstreams() -> None:
    assert DEFAULT_PRESET == EvalPreset(crop_size=224, resize_size=256) == EvalPreset.for_image_size(224)
    assert (DEFAULT_PRESET.interpolation, DEFAULT_PRESET.mean, DEFAULT_PRESET.std) == ("bilinear", MEAN, STD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_PRESET.crop_size = 1  # type: ignore[misc]


def test_lists_become_tuples() -> None:
    preset = EvalPreset(crop_size=8, resize_size=9, mean=[0.5, 0.5, 0.5], std=[1, 1, 1])  # type: ignore[arg-type]
    assert preset.mean == (0.5, 0.5, 0.5) and preset.std == (1.0, 1.0, 1.0)
    assert hash(preset) == hash(EvalPreset(crop_size=8, resize_size=9, mean=(0.5,) * 3, std=(1.0,) * 3))


@pytest.mark.parametrize(("fields", "text"), [
    ({"crop_size": 0, "resize_size": 256}, "crop_size must be a positive int"),
    ({"crop_size": 224.0, "resize_size": 256}, "crop_size must be a positive int"),
    ({"crop_size": True, "resize_size": 256}, "crop_size must be a positive int"),
    ({"crop_size": 224, "resize_size": -1}, "resize_size must be a positive int"),
    ({"crop_size": 300, "resize_size": 256}, "larger than resize_size"),
    ({"crop_size": 224, "resize_size": 256, "interpolation": "lanczos"}, "interpolation must be one of"),
    ({"crop_size": 224, "resize_size": 256, "mean": (0.5, 0.5)}, "mean must be three"),
    ({"crop_size": 224, "resize_size": 256, "mean": "abc"}, "mean must be three"),
    ({"crop_size": 224, "resize_size": 256, "std": (0.2, 0.0, 0.2)}, "std must be three positive"),
    ({"crop_size": 224, "resize_size": 256, "std": (0.2, float("nan"), 0.2)}, "std must be three positive"),
])
def test_invalid_fields(fields: dict, text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=text) as info:
        EvalPreset(**fields)
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working


def test_for_image_size_rejects_bad_sizes() -> None:
    for size in (0, -3, 2.5, None):
        with pytest.raises(InvalidArgumentError, match="crop_size"):
            EvalPreset.for_image_size(size)  # type: ignore[arg-type]


def test_preset_for_model() -> None:
    assert preset_for_model(torch.nn.Identity()) == DEFAULT_PRESET  # no input_size: the default
    assert preset_for_model(SimpleNamespace(input_size=224)) == DEFAULT_PRESET
    assert preset_for_model(SimpleNamespace(input_size=160)) == EvalPreset(crop_size=160, resize_size=183)
    with pytest.raises(InvalidArgumentError):
        preset_for_model(SimpleNamespace(input_size=0))


def test_training_checkpoint_image_size_gives_the_preset() -> None:
    # What load_model does with a `convnets train` checkpoint's metadata.
    model = SimpleNamespace(num_classes=2, class_names=None, input_size=224)
    record = ModelRecord.from_metadata({"config": {"image_size": 96}, "class_names": ["a", "b"]})
    _apply_metadata(model, record)  # type: ignore[arg-type]
    assert preset_for_model(model) == EvalPreset(crop_size=96, resize_size=110)


# ---- the manifest owns the presets of its weights ----------------------------------------------

def _raw_manifest() -> dict:
    return json.loads((REPO / "weights_manifest.json").read_text(encoding="utf-8"))


def test_manifest_fields_are_the_preset() -> None:
    raw = _raw_manifest()["models"]
    manifest = load_manifest()
    assert set(manifest) == set(raw)
    for name, entry in manifest.items():
        fields = raw[name]
        assert entry.preset == EvalPreset(crop_size=fields["input_size"], resize_size=fields["resize_size"],
                                          interpolation=fields["interpolation"], mean=tuple(fields["mean"]),
                                          std=tuple(fields["std"])), name


def _edited_manifest(tmp_path: Path, **fields: object) -> Path:
    data = _raw_manifest()
    data["models"]["resnet50"].update(fields)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_edited_manifest_changes_the_preset(tmp_path: Path) -> None:
    path = _edited_manifest(tmp_path, input_size=160, resize_size=200, interpolation="bicubic",
                            mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3])
    assert load_manifest(str(path))["resnet50"].preset == EvalPreset(160, 200, "bicubic", (0.5, 0.4, 0.3),
                                                                    (0.2, 0.25, 0.3))


@pytest.mark.parametrize(("fields", "text"), [
    ({"interpolation": "area"}, "interpolation"),
    ({"input_size": 300}, "larger than resize_size"),
    ({"std": [0.2, 0, 0.2]}, "std"),
])
def test_manifest_with_an_impossible_preset_is_refused(tmp_path: Path, fields: dict, text: str) -> None:
    with pytest.raises(ManifestError, match=f"models.resnet50.*{text}"):
        load_manifest(str(_edited_manifest(tmp_path, **fields)))


@pytest.mark.parametrize("fields", [
    {},  # the shipped manifest
    {"input_size": 160, "resize_size": 200, "interpolation": "bicubic", "mean": [0.5, 0.4, 0.3],
     "std": [0.2, 0.25, 0.3]},
    {"input_size": 96, "resize_size": 96, "interpolation": "nearest"},
])
def test_pipelines_use_the_manifest_preset(tmp_path: Path, fields: dict) -> None:
    """prepare_batch, prepare_input_from_uri and predict give exactly the Compose built from the JSON."""
    raw = {**_raw_manifest()["models"]["resnet50"], **fields}
    preset = load_manifest(str(_edited_manifest(tmp_path, **fields)))["resnet50"].preset
    reference = compose(raw["input_size"], raw["resize_size"], raw["interpolation"], raw["mean"], raw["std"])
    expected = torch.stack([reference(Image.open(p).convert("RGB")) for p in EXAMPLES])

    assert torch.equal(prepare_batch(EXAMPLES, preset=preset).tensor, expected)
    assert torch.equal(prepare_input_from_uri(EXAMPLES, preset=preset), expected)

    seen: list[torch.Tensor] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return torch.zeros(len(x), 3)

    results = list(predict(model, [str(p) for p in EXAMPLES], labels=["a", "b", "c"], preset=preset))
    assert len(results) == len(EXAMPLES) and all(r.ok for r in results)
    assert torch.equal(torch.cat(seen), expected)


def test_predict_takes_the_model_preset() -> None:
    """A model's ``input_size`` (from its checkpoint) sets the crop and the resize of predict."""
    seen: list[torch.Tensor] = []

    class Model:
        input_size = 160

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x)
            return torch.zeros(len(x), 2)

    list(predict(Model(), [str(EXAMPLES[0])], labels=["a", "b"]))
    expected = compose(160, 183)(Image.open(EXAMPLES[0]).convert("RGB")).unsqueeze(0)
    assert torch.equal(seen[0], expected)


def test_prepare_batch_refuses_sizes_that_contradict_the_preset() -> None:
    preset = EvalPreset.for_image_size(160)
    with pytest.raises(InvalidArgumentError, match="contradict"):
        prepare_batch(EXAMPLES[:1], preset=preset, image_size=128)
    # Sizes that agree with the preset are accepted.
    assert prepare_batch(EXAMPLES[:1], preset=preset, image_size=160, resize_size=183).tensor.shape[-1] == 160


# ---- the validation loader and predict agree, bit for bit --------------------------------------

def _odd_images() -> dict[str, Image.Image]:
    """Generated images of odd sizes and modes, with content (a gradient plus noise)."""
    rng = np.random.default_rng(0)

    def pixels(h: int, w: int, c: int) -> np.ndarray:
        ramp = np.linspace(0, 255, w)[None, :, None] * np.linspace(0.2, 1, h)[:, None, None]
        return np.clip(ramp + rng.normal(0, 20, (h, w, c)), 0, 255).astype(np.uint8)

    rgb = Image.fromarray(pixels(301, 37, 3))
    exif = Image.fromarray(pixels(90, 250, 3)).getexif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees on display
    rotated = Image.fromarray(pixels(90, 250, 3))
    rotated.info["exif"] = exif.tobytes()
    return {
        "tall_rgb.png": rgb,
        "wide_gray.png": Image.fromarray(pixels(17, 500, 1)[:, :, 0], "L"),
        "rgba.png": Image.fromarray(np.dstack([pixels(123, 77, 3), pixels(123, 77, 1)]), "RGBA"),
        "palette.png": rgb.convert("P", palette=Image.Palette.ADAPTIVE),
        "wide16.png": Image.fromarray(pixels(45, 61, 1)[:, :, 0].astype(np.uint16) * 257),
        "cmyk.jpg": Image.fromarray(pixels(64, 99, 3)).convert("CMYK"),
        "tiny.png": Image.fromarray(pixels(5, 7, 3)),  # smaller than the crop: upsampled
        "rotated.jpg": rotated,
    }


@pytest.fixture(scope="module")
def val_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("presets_data")
    for cls in ("examples", "generated"):
        (root / "val" / cls).mkdir(parents=True)
    for path in EXAMPLES:
        shutil.copy(path, root / "val" / "examples" / path.name)
    for name, image in _odd_images().items():
        target = root / "val" / "generated" / name
        if name == "rotated.jpg":
            image.save(target, exif=image.info["exif"], quality=95)
        else:
            image.save(target)
    return root


@pytest.mark.parametrize("image_size", [224, 64, 33])
def test_validation_loader_and_predict_agree_bitwise(val_root: Path, image_size: int) -> None:
    """The ``pytorch`` validation batches (uint8, normalised on the device) equal prepare_batch's."""
    data = make_data("pytorch", val_root, batch_size=4, image_size=image_size, workers=0, seed=0,
                     ctx=DistContext(0, 1, 0, CPU), train=False)
    batches = list(data.val())
    assert sum(bad for _, _, bad in batches) == 0
    loader = torch.cat([to_device(x, CPU, torch.contiguous_format) for x, _, _ in batches])
    _, samples = scan_split(val_root, "val")
    assert len(samples) == len(EXAMPLES) + len(_odd_images()) == len(loader)

    preset = EvalPreset.for_image_size(image_size)
    predicted = prepare_batch([path for path, _ in samples], preset=preset)
    assert predicted.errors == []
    assert loader.dtype == predicted.tensor.dtype == torch.float32
    assert torch.equal(loader, predicted.tensor)


def test_val_transform_is_the_preset_resize_and_crop() -> None:
    """Before normalisation the validation pixels are exactly torchvision's PIL resize + crop."""
    preset = EvalPreset(crop_size=100, resize_size=130, interpolation="bicubic")
    image = load_image(EXAMPLES[0])
    expected = transforms.Compose([
        transforms.Resize(130, interpolation=transforms.InterpolationMode.BICUBIC, antialias=True),
        transforms.CenterCrop(100), transforms.PILToTensor()])(image)
    got = val_transform(preset)(image)
    assert got.dtype == torch.uint8 and torch.equal(got, expected)
    assert torch.equal(val_transform(224)(image), val_transform(DEFAULT_PRESET)(image))
