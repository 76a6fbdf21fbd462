"""The architectures of the family as data: :class:`ArchSpec` and the registered models.

Adding an architecture is one :func:`register_model` call here and its builder function in
:mod:`convnets.builders` (plus, if it has pretrained weights, an entry in ``weights_manifest.json``):
the torch.hub entry points, :func:`list_models` and ``--model``'s choices come from :data:`MODELS`.

Imports nothing heavy (no torch), so that the command line can list model names before it
imports PyTorch. :mod:`convnets.models.resnet` builds a network from a spec.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sized
from dataclasses import dataclass
from typing import Any, TypeGuard

from convnets.errors import InvalidArgumentError, UnknownArgumentError, short_repr

__all__ = ["ARCH_FIELDS", "MAX_BLOCKS", "MAX_CHANNELS", "MAX_CLASSES", "MAX_EXPANSION", "MAX_STAGES", "MODELS",
           "MODEL_SPECS", "ArchSpec", "ModelInfo", "check_num_classes", "list_models", "register_model",
           "registered_name"]


#: Most stages (entries of ``layers`` / ``widths``). Every published member has 4.
MAX_STAGES = 16
#: Most bottleneck blocks, in all stages together. The deepest ResNet in the literature, ResNet-1001,
#: has 333 (111 a stage); ResNet-200 has 66. Building 1000 blocks takes about a second and 160 MB
#: even on the meta device (each block is a dozen Python modules), so the bound is checked first.
MAX_BLOCKS = 1000
#: Most channels of any width: ``widths``, ``stem_width``, ``se_squeeze`` and ``cardinality``
#: (published: at most 1024; wide ResNets 2048).
MAX_CHANNELS = 65536
#: Largest ``expansion`` (published: 4 for ResNet-50, 2 for ResNeXt).
MAX_EXPANSION = 64
#: Most classifier outputs: ``num_classes``, recorded ``class_names`` (ImageNet-21k has 21,841).
MAX_CLASSES = 1_000_000

def _is_positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _as_int_tuple(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"invalid architecture: {name} must be a list of integers, got {short_repr(value)}")
    # At most one entry past the limit is taken, so that a huge (or endless) iterable costs nothing.
    items = tuple(itertools.islice(value, MAX_STAGES + 1))
    if len(items) > MAX_STAGES:
        length = f"{len(value)} entries" if isinstance(value, Sized) else "more entries"
        raise InvalidArgumentError(f"invalid architecture: {name} has {length}, at most {MAX_STAGES} stages are "
                                   f"allowed, got {short_repr(value)}")
    return items


def _in_range(value: object, limit: int) -> bool:
    return _is_positive_int(value) and value <= limit


def check_num_classes(value: object, name: str = "num_classes") -> int:
    """``value`` if it is a number of classifier outputs: an int from 0 (no classifier) to :data:`MAX_CLASSES`.

    Args:
        value: the number.
        name: how the caller's interface spells it, for the message.

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CLASSES:
        raise InvalidArgumentError(f"{name} must be an integer from 0 to {MAX_CLASSES}, got {short_repr(value)}")
    return value


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

    Every size is bounded, so that a mistaken or hostile record (a checkpoint's ``arch_spec``,
    ``--arch-kwargs``) is refused before anything is built: at most :data:`MAX_STAGES` stages and
    :data:`MAX_BLOCKS` blocks in all, channels up to :data:`MAX_CHANNELS`, ``expansion`` up to
    :data:`MAX_EXPANSION`.

    Raises:
        InvalidArgumentError: a field of the wrong type, out of those bounds, or inconsistent
            (``layers`` and ``widths`` of different lengths, widths not divisible by ``cardinality``).
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
            problems.append(f"layers {short_repr(list(self.layers))} and widths {short_repr(list(self.widths))} must be "
                            "non-empty and of the same length (one entry per stage)")
        for field_name, limit in (("layers", MAX_BLOCKS), ("widths", MAX_CHANNELS)):
            values = getattr(self, field_name)
            if not all(_is_positive_int(v) for v in values):
                problems.append(f"{field_name} must hold positive integers, got {short_repr(list(values))}")
            elif not all(v <= limit for v in values):
                problems.append(f"{field_name} must hold integers of at most {limit}, got {short_repr(list(values))}")
        if all(_in_range(v, MAX_BLOCKS) for v in self.layers) and sum(self.layers) > MAX_BLOCKS:
            problems.append(f"layers {short_repr(list(self.layers))} add up to {sum(self.layers)} blocks, at most "
                            f"{MAX_BLOCKS} are allowed")
        for field_name, limit in (("expansion", MAX_EXPANSION), ("cardinality", MAX_CHANNELS),
                                  ("stem_width", MAX_CHANNELS)):
            if not _in_range(getattr(self, field_name), limit):
                problems.append(f"{field_name} must be a positive integer of at most {limit}, got "
                                f"{short_repr(getattr(self, field_name))}")
        if self.se_squeeze is not None and not _in_range(self.se_squeeze, MAX_CHANNELS):
            problems.append(f"se_squeeze must be None or a positive integer of at most {MAX_CHANNELS}, got "
                            f"{short_repr(self.se_squeeze)}")
        if _is_positive_int(self.cardinality) and all(_is_positive_int(w) for w in self.widths):
            bad = [w for w in self.widths if w % self.cardinality]
            if bad:
                problems.append(f"widths {short_repr(bad)} are not divisible by cardinality "
                                f"{short_repr(self.cardinality)}")
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
        hub_names: torch.hub entry points in ``hubconf.py`` that build it, e.g.
            ``("nvidia_resnext101_32x4d", "nvidia_resneXt")``.
    """

    name: str
    spec: ArchSpec
    hub_names: tuple[str, ...]


#: name -> registration, in registration order. Fill it with :func:`register_model` only.
MODELS: dict[str, ModelInfo] = {}

#: name -> published architecture (a view of :data:`MODELS`, kept for existing callers).
MODEL_SPECS: dict[str, ArchSpec] = {}


def register_model(name: str, spec: ArchSpec, *, hub_names: tuple[str, ...] = ()) -> ModelInfo:
    """Register an architecture: its torch.hub entry points, ``list_models()``, ``get_model(name)``,
    ``--model``'s choices and the tests' parametrisation all follow from this. Its builder, the
    function of the same name in :mod:`convnets.builders`, is the one other place a model is added.

    Pretrained weights are registered separately, as an entry of ``weights_manifest.json`` under the
    same name; a model without one builds with random weights and refuses ``pretrained=True``.

    Args:
        name: a lowercase Python identifier, e.g. ``"resnet101"``.
        spec: the published architecture.
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
    info = ModelInfo(name=name, spec=spec, hub_names=hub_names)
    MODELS[name] = info
    MODEL_SPECS[name] = spec
    return info


# --- The published architectures. Parameter counts: 25,557,032 / 44,177,704 / 45,251,128. ---------

_RESNEXT101_32X4D = ArchSpec(layers=(3, 4, 23, 3), widths=(128, 256, 512, 1024), expansion=2, cardinality=32)

register_model("resnet50", ArchSpec(layers=(3, 4, 6, 3), widths=(64, 128, 256, 512), expansion=4))
# nvidia_resneXt: upstream's alias
register_model("resnext101_32x4d", _RESNEXT101_32X4D, hub_names=("nvidia_resnext101_32x4d", "nvidia_resneXt"))
register_model("se_resnext101_32x4d", _RESNEXT101_32X4D.replace(se_squeeze=16))


def registered_name(spec: ArchSpec) -> str | None:
    """The name under which ``spec`` is published in :data:`MODEL_SPECS`, or ``None``."""
    return next((name for name, published in MODEL_SPECS.items() if published == spec), None)


def list_models() -> list[str]:
    """Names of the registered architectures, e.g. ``['resnet50', 'resnext101_32x4d', ...]``."""
    return sorted(MODEL_SPECS)

