"""The architectures of the family as data: :class:`ArchSpec` and the registered models.

Imports nothing heavy (no torch), so that the command line can list model names before it
imports PyTorch. :mod:`convnets.models.resnet` builds a network from a spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from convnets.errors import InvalidArgumentError, UnknownArgumentError

__all__ = ["ARCH_FIELDS", "ArchSpec", "MODEL_SPECS", "list_models", "registered_name"]


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _as_int_tuple(name: str, value: object) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"invalid architecture: {name} must be a list of integers, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class ArchSpec:
    """Everything that distinguishes one member of the family from another.

    Args:
        layers: bottleneck blocks per stage.
        widths: channels of each stage's 1x1 reduce and grouped 3x3 convolutions.
        expansion: output channels of a block are ``width * expansion``.
        cardinality: groups of the 3x3 convolution (1 = plain ResNet).
        se_squeeze: hidden width of the squeeze-and-excitation gate, the same in every stage
            (NVIDIA uses 16); ``None`` builds blocks without SE.
        stem_width: output channels of the 7x7 stem convolution.
    """

    layers: tuple[int, ...]
    widths: tuple[int, ...]
    expansion: int
    cardinality: int = 1
    se_squeeze: int | None = None
    stem_width: int = 64

    def __post_init__(self) -> None:
        # Lists from JSON or keyword arguments become tuples so that specs stay hashable.
        object.__setattr__(self, "layers", _as_int_tuple("layers", self.layers))
        object.__setattr__(self, "widths", _as_int_tuple("widths", self.widths))
        problems = []
        if not self.layers or len(self.layers) != len(self.widths):
            problems.append(f"layers {list(self.layers)} and widths {list(self.widths)} must be "
                            "non-empty and of the same length (one entry per stage)")
        for field_name in ("layers", "widths"):
            if not all(_is_positive_int(v) for v in getattr(self, field_name)):
                problems.append(f"{field_name} must hold positive integers, got {list(getattr(self, field_name))}")
        for field_name in ("expansion", "cardinality", "stem_width"):
            if not _is_positive_int(getattr(self, field_name)):
                problems.append(f"{field_name} must be a positive integer, got {getattr(self, field_name)!r}")
        if self.se_squeeze is not None and not _is_positive_int(self.se_squeeze):
            problems.append(f"se_squeeze must be a positive integer or None, got {self.se_squeeze!r}")
        if _is_positive_int(self.cardinality) and all(_is_positive_int(w) for w in self.widths):
            bad = [w for w in self.widths if w % self.cardinality]
            if bad:
                problems.append(f"widths {bad} are not divisible by cardinality {self.cardinality}")
        if problems:
            raise InvalidArgumentError("invalid architecture: " + "; ".join(problems))

    @property
    def num_features(self) -> int:
        """Channels of the last stage, i.e. the input width of the classifier."""
        return self.widths[-1] * self.expansion

    def replace(self, **overrides: Any) -> ArchSpec:
        """A copy with some fields changed, e.g. ``spec.replace(layers=[1, 1, 1, 1])``."""
        unknown = sorted(set(overrides) - set(ARCH_FIELDS))
        if unknown:
            raise UnknownArgumentError(f"unknown architecture field(s) {unknown}; the fields are {list(ARCH_FIELDS)}")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict that ``ArchSpec(**d)`` turns back into this spec."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


ARCH_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ArchSpec))

_RESNEXT101_32X4D = ArchSpec(layers=(3, 4, 23, 3), widths=(128, 256, 512, 1024), expansion=2, cardinality=32)

#: The published architectures. Parameter counts: 25,557,032 / 44,177,704 / 45,251,128.
MODEL_SPECS: dict[str, ArchSpec] = {
    "resnet50": ArchSpec(layers=(3, 4, 6, 3), widths=(64, 128, 256, 512), expansion=4),
    "resnext101_32x4d": _RESNEXT101_32X4D,
    "se_resnext101_32x4d": _RESNEXT101_32X4D.replace(se_squeeze=16),
}


def registered_name(spec: ArchSpec) -> str | None:
    """The name under which ``spec`` is published in :data:`MODEL_SPECS`, or ``None``."""
    return next((name for name, published in MODEL_SPECS.items() if published == spec), None)


def list_models() -> list[str]:
    """Names of the registered architectures, e.g. ``['resnet50', 'resnext101_32x4d', ...]``."""
    return sorted(MODEL_SPECS)

