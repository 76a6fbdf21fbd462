"""``weights_manifest.json``: the one description of every pretrained checkpoint.

The file sits at the repository root (where ``torch.hub.load`` from a checkout finds it through the
``convnets/weights_manifest.json`` symlink) and is copied into the wheel, so both ways of installing
read the same data. It is validated when first read: a malformed entry fails loudly, naming the
entry and the field, instead of surfacing later as a confusing download or load error.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from convnets.errors import InvalidArgumentError, ManifestError
from convnets.preprocessing.presets import EvalPreset

__all__ = ["WeightsEntry", "load_manifest"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class WeightsEntry:
    """Where a model's pretrained weights live and what they are.

    Attributes:
        model: registry name of the architecture the weights belong to.
        url: download address (its host is replaced by ``CONVNETS_WEIGHTS_MIRROR`` when set).
        file_name: name of the file in the cache and on mirrors.
        layout: checkpoint layout as published (see :mod:`convnets.weights.layouts`).
        sha256: hex digest of the file, or ``None`` where no trusted digest is known.
        size_bytes: file size, or ``None`` where unknown.
        top1: published ImageNet top-1 accuracy in percent, or ``None``.
        top1_note: what the top-1 figure refers to.
        num_params: parameter count of the model the weights fit.
        num_classes: outputs of the checkpoint's classifier.
        input_size: evaluation crop size.
        resize_size: shorter side before the crop.
        interpolation: resize interpolation.
        mean: per-channel normalisation mean (RGB, 0..1 scale).
        std: per-channel normalisation standard deviation.
        license: licence of the weights.
        source: page that publishes them.
    """

    model: str
    url: str
    file_name: str
    layout: str
    sha256: str | None
    size_bytes: int | None
    top1: float | None
    top1_note: str
    num_params: int
    num_classes: int
    input_size: int
    resize_size: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    license: str
    source: str

    @property
    def preset(self) -> EvalPreset:
        """The evaluation preset these weights were published with (crop, resize, interpolation,
        mean, std), what every eval path uses for them."""
        return EvalPreset(crop_size=self.input_size, resize_size=self.resize_size,
                          interpolation=self.interpolation, mean=self.mean, std=self.std)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "url": (str,), "file_name": (str,), "layout": (str,), "sha256": (str, type(None)),
    "size_bytes": (int, type(None)), "top1": (float, int, type(None)), "top1_note": (str,),
    "num_params": (int,), "num_classes": (int,), "input_size": (int,), "resize_size": (int,),
    "interpolation": (str,), "mean": (list,), "std": (list,), "license": (str,), "source": (str,),
}


def _parse_entry(model: str, raw: Any, origin: str) -> WeightsEntry:
    where = f"{origin}: models.{model}"
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must be an object, got {type(raw).__name__}")
    missing = sorted(set(_FIELD_TYPES) - set(raw))
    unknown = sorted(set(raw) - set(_FIELD_TYPES))
    if missing or unknown:
        raise ManifestError(f"{where}: missing fields {missing}, unknown fields {unknown}")
    for name, types in _FIELD_TYPES.items():
        value = raw[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise ManifestError(f"{where}.{name} has the wrong type {type(value).__name__}")
    if not raw["url"].startswith("https://"):
        raise ManifestError(f"{where}.url must be an https URL, got {raw['url']!r}")
    if "/" in raw["file_name"] or raw["file_name"] in ("", ".", ".."):
        raise ManifestError(f"{where}.file_name must be a plain file name, got {raw['file_name']!r}")
    if raw["sha256"] is not None and not _SHA256.match(raw["sha256"]):
        raise ManifestError(f"{where}.sha256 must be 64 lowercase hex digits or null")
    for name in ("mean", "std"):
        if len(raw[name]) != 3 or not all(isinstance(v, (int, float)) for v in raw[name]):
            raise ManifestError(f"{where}.{name} must hold three numbers")
    entry = WeightsEntry(model=model, **{**raw, "mean": tuple(raw["mean"]), "std": tuple(raw["std"])})
    try:
        entry.preset  # noqa: B018  (a preset that cannot be built fails here, naming the entry)
    except InvalidArgumentError as e:
        raise ManifestError(f"{where}: input_size / resize_size / interpolation / mean / std do not "
                            f"form an evaluation preset: {e}") from e
    return entry


@functools.lru_cache(maxsize=None)
def load_manifest(path: str | None = None) -> dict[str, WeightsEntry]:
    """Read and validate the manifest.

    Args:
        path: a manifest file to read instead of the packaged one.

    Returns:
        A dict from model name to its :class:`WeightsEntry`.

    Raises:
        ManifestError: the file is not valid JSON or an entry is malformed.
    """
    source = Path(path) if path else resources.files("convnets").joinpath("weights_manifest.json")
    origin = str(source)
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ManifestError(f"cannot read the weights manifest {origin}: {e}") from e
    if not isinstance(data, dict) or data.get("schema_version") != 1 or not isinstance(data.get("models"), dict):
        raise ManifestError(f"{origin} is not a version-1 weights manifest (expected "
                            "'schema_version': 1 and a 'models' object)")
    return {name: _parse_entry(name, raw, origin) for name, raw in data["models"].items()}
