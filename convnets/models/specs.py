"""The architectures of the family as data: :class:`ArchSpec` and the registered models.

Adding an architecture is one :func:`register_model` call here (plus, if it has pretrained
weights, an entry in ``weights_manifest.json``): the builder ``convnets.<name>``, the torch.hub
entry points and :func:`list_models` are generated from :data:`MODELS`.

Imports nothing heavy (no torch), so that the command line can list model names before it
imports PyTorch. :mod:`convnets.models.resnet` builds a network from a spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from convnets.errors import InvalidArgumentError, UnknownArgumentError

__all__ = ["ARCH_FIELDS", "MODELS", "MODEL_SPECS", "ArchSpec", "ModelInfo", "list_models", "register_model",
           "registered_name"]


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _as_int_tuple(name: str, value: object) -> tuple[Any, ...]:
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

@dataclass(frozen=True)
class ModelInfo:
    """One registered architecture: everything the builders, torch.hub and the CLI derive from.

    Attributes:
        name: registry name, e.g. ``"resnet50"`` (also the builder's name, ``convnets.resnet50``).
        spec: the published architecture.
        summary: first paragraph of the builder's docstring (what it is, parameter count, paper).
        hub_names: torch.hub entry points in ``hubconf.py`` that build it, e.g.
            ``("nvidia_resnext101_32x4d", "nvidia_resneXt")``.
    """

    name: str
    spec: ArchSpec
    summary: str
    hub_names: tuple[str, ...]


#: name -> registration, in registration order. Fill it with :func:`register_model` only.
MODELS: dict[str, ModelInfo] = {}

#: name -> published architecture (a view of :data:`MODELS`, kept for existing callers).
MODEL_SPECS: dict[str, ArchSpec] = {}


def register_model(name: str, spec: ArchSpec, *, summary: str, hub_names: tuple[str, ...] = ()) -> ModelInfo:
    """Register an architecture: its builder ``convnets.<name>``, its torch.hub entry points,
    ``list_models()``, ``get_model(name)`` and the tests' parametrisation all follow from this.

    Pretrained weights are registered separately, as an entry of ``weights_manifest.json`` under the
    same name; a model without one builds with random weights and refuses ``pretrained=True``.

    Args:
        name: a lowercase Python identifier, e.g. ``"resnet101"``.
        spec: the published architecture.
        summary: one paragraph for the builder's docstring (parameter count, paper links).
        hub_names: torch.hub entry-point names; default ``("nvidia_<name>",)``.

    Returns:
        The stored :class:`ModelInfo`.

    Raises:
        InvalidArgumentError: the name is not a lowercase identifier, or a name is taken.
    """
    hub_names = tuple(hub_names) or (f"nvidia_{name}",)
    if not (name.isidentifier() and name == name.lower()) or name in MODELS:
        raise InvalidArgumentError(f"cannot register model {name!r}: it must be a new lowercase identifier "
                                   f"(registered: {', '.join(MODELS)})")
    taken = {hub for info in MODELS.values() for hub in info.hub_names}
    bad = [h for h in hub_names if not h.isidentifier() or h.startswith("_") or h in taken]
    if bad or len(set(hub_names)) != len(hub_names):
        raise InvalidArgumentError(f"cannot register model {name!r}: hub_names {list(hub_names)} must be new, "
                                   f"distinct public identifiers (not {bad or 'repeated'})")
    info = ModelInfo(name=name, spec=spec, summary=summary.strip(), hub_names=hub_names)
    MODELS[name] = info
    MODEL_SPECS[name] = spec
    return info


# --- The published architectures. Parameter counts: 25,557,032 / 44,177,704 / 45,251,128. ---------

_RESNEXT101_32X4D = ArchSpec(layers=(3, 4, 23, 3), widths=(128, 256, 512, 1024), expansion=2, cardinality=32)

register_model(
    "resnet50", ArchSpec(layers=(3, 4, 6, 3), widths=(64, 128, 256, 512), expansion=4),
    summary="""ResNet-50 v1.5 (25,557,032 parameters), NVIDIA's training recipe.

    Paper: https://arxiv.org/abs/1512.03385 ; v1.5 moves the stride to the 3x3 convolution.""",
    hub_names=("nvidia_resnet50",))
register_model(
    "resnext101_32x4d", _RESNEXT101_32X4D,
    summary="""ResNeXt101-32x4d (44,177,704 parameters): ResNet-101 with 32-group 3x3 convolutions.

    Paper: https://arxiv.org/abs/1611.05431 . NGC weights: 80.19% ImageNet top-1 (AMP, 250 epochs).""",
    hub_names=("nvidia_resnext101_32x4d", "nvidia_resneXt"))  # upstream's alias
register_model(
    "se_resnext101_32x4d", _RESNEXT101_32X4D.replace(se_squeeze=16),
    summary="""SE-ResNeXt101-32x4d (45,251,128 parameters): ResNeXt101-32x4d with NVIDIA's SE blocks.

    Papers: https://arxiv.org/abs/1611.05431 , https://arxiv.org/abs/1709.01507 . The SE squeeze is
    a fixed 16 channels (not C/16 as in timm). NGC weights: 80.90% ImageNet top-1 (AMP, 250 epochs).""",
    hub_names=("nvidia_se_resnext101_32x4d",))


def registered_name(spec: ArchSpec) -> str | None:
    """The name under which ``spec`` is published in :data:`MODEL_SPECS`, or ``None``."""
    return next((name for name, published in MODEL_SPECS.items() if published == spec), None)


def list_models() -> list[str]:
    """Names of the registered architectures, e.g. ``['resnet50', 'resnext101_32x4d', ...]``."""
    return sorted(MODEL_SPECS)

