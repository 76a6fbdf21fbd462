"""The inference-engine plug-in interface (:mod:`convnets.deploy.engines`) and the settings every
engine is built with (:class:`EngineSettings`). No PyTorch is imported here.

An engine module imports nothing heavy at import time either (PyTorch, ONNX Runtime, OpenVINO
only inside :meth:`Engine.build` / :meth:`Engine.check`): ``--help`` imports every engine module to
list their names and :meth:`Engine.help_line` without loading them.
"""

from __future__ import annotations

import abc
import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from convnets.constants import MAX_THREADS
from convnets.deploy.formats.base import require
from convnets.errors import InvalidArgumentError, UnsupportedPrecisionError
from convnets.runtime import setting

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DEFAULT_SETTINGS", "Engine", "EngineSettings", "SettingOption", "setting_options"]


@dataclasses.dataclass(frozen=True)
class SettingOption:
    """How one :class:`EngineSettings` field is offered and passed on (the field's ``metadata["option"]``).

    The command line's option (``flag``, ``metavar``, ``help``), how its text is read (``parse``) and
    what a value must be (``valid``, described by ``expected``) are the field's only definition:
    :func:`convnets.commands.run_options.add_engine_settings_arguments` generates the option from
    them, and :class:`EngineSettings` checks Python values with them. ``runtimes`` names the
    property that carries the value into each runtime that has one (engine name -> ONNX Runtime
    ``SessionOptions`` attribute, OpenVINO CPU property, ...): :meth:`EngineSettings.runtime_options`.
    """

    flag: str
    metavar: str
    help: str
    parse: Callable[[str], Any]
    valid: Callable[[Any], bool]
    expected: str
    runtimes: Mapping[str, str] = dataclasses.field(default_factory=dict)


def _count(text: str) -> int:
    """A count written in decimal digits only (no sign, no ``1_000``, nothing huge to convert)."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 18):
        raise ValueError(text)
    return int(digits)


def _thread_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_THREADS


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """How an engine runs the model it builds: one object from the command line (``--threads``)
    through :func:`~convnets.deploy.optimize.optimize_for_inference` (``settings=``) to each
    engine's :meth:`Engine.build`.

    A field with an ``"option"`` (:class:`SettingOption`) becomes a command-line option of
    ``predict``, ``embed``, ``evaluate`` and ``benchmark``, and reaches the runtimes its
    ``runtimes`` names; ``None`` leaves each runtime at its own default.

    Attributes:
        threads: the threads that compute one batch: ``torch.set_num_threads`` around each call of
            the torch engine's module (restored after it), ONNX Runtime's ``intra_op_num_threads``,
            OpenVINO's ``INFERENCE_NUM_THREADS`` (which the CPU plugin caps at the cores it can
            use). ``None``: each runtime's default (every core).
        runtime: more of a runtime's own settings, per engine name, over those the fields above give:
            ``{"onnxruntime": {"execution_mode": "ORT_PARALLEL"}, "openvino": {"NUM_STREAMS": "2"}}``
            (see the onnx format's ``load_runner`` and the openvino engine's ``build``); what
            benchmarks/bench_engines.py ``--settings`` compares.

    Raises:
        InvalidArgumentError: a value the field does not take (naming the keyword).
    """

    threads: int | None = dataclasses.field(default=None, metadata={"option": SettingOption(
        "--threads", "N", "threads that compute each batch: torch.set_num_threads during each batch, ONNX "
        "Runtime's intra_op_num_threads, OpenVINO's INFERENCE_NUM_THREADS (default: each runtime's own, every "
        "core)",
        parse=_count, valid=_thread_count, expected=f"a positive integer of at most {MAX_THREADS}",
        runtimes={"onnxruntime": "intra_op_num_threads", "openvino": "INFERENCE_NUM_THREADS"})})
    runtime: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field, option in setting_options():
            value = getattr(self, field.name)
            if value is not None and not option.valid(value):
                raise InvalidArgumentError(f"{field.name} must be {option.expected} or None, got {value!r}",
                                           keyword=field.name)
        if not isinstance(self.runtime, Mapping) or not all(
                isinstance(k, str) and isinstance(v, Mapping) for k, v in self.runtime.items()):
            raise InvalidArgumentError("runtime must map engine names to mappings of their settings, "
                                       f"got {self.runtime!r}", keyword="runtime")
        # Read-only copies: the settings are shared by every engine that auto tries.
        object.__setattr__(self, "runtime", types.MappingProxyType(
            {k: types.MappingProxyType(dict(v)) for k, v in self.runtime.items()}))

    def runtime_options(self, engine: str) -> dict[str, Any]:
        """The settings of engine ``engine``'s runtime: the fields it has a property for (those not
        ``None``), then ``runtime[engine]`` over them."""
        options = {option.runtimes[engine]: getattr(self, field.name)
                   for field, option in setting_options()
                   if engine in option.runtimes and getattr(self, field.name) is not None}
        return {**options, **self.runtime.get(engine, {})}


def setting_options() -> tuple[tuple[dataclasses.Field[Any], SettingOption], ...]:
    """The :class:`EngineSettings` fields that are options, each with its :class:`SettingOption`."""
    return tuple((f, f.metadata["option"]) for f in dataclasses.fields(EngineSettings) if "option" in f.metadata)


#: The settings when none are given: every runtime at its defaults.
DEFAULT_SETTINGS = EngineSettings()


class Engine(abc.ABC):
    """An inference engine: turns an eval-mode classifier into a fast callable.

    Attributes:
        name: what ``engine=`` / ``--engine`` calls it.
        description: one line for help texts: what runs the model (the devices, precisions and
            extra are added from the attributes below by :meth:`help_line`).
        devices: device types it runs on.
        precisions: precisions it computes in (on those devices).
        requires: modules that must import (optional packages).
        extra: the pip extra of ``convnets-hub`` that installs :attr:`requires`.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    requires: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = "export"

    @abc.abstractmethod
    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool,
              settings: EngineSettings = DEFAULT_SETTINGS,
              calibration_data: list[torch.Tensor] | None = None) -> nn.Module:
        """The optimized callable for ``model`` (eval mode; not modified), checks already done.

        Returns a module that takes an NCHW float batch of any size and returns float32 logits, with
        an ``engine`` attribute naming this engine.

        ``settings``: how it runs (:class:`EngineSettings`; its :meth:`~EngineSettings.runtime_options`
        for this engine's name are the runtime's). ``calibration_data``: passed by
        ``optimize_for_inference`` for ``"int8"`` only, as a list of batches (the part that
        :func:`~convnets.deploy.calibrate.split_calibration` keeps for calibration; the rest checks
        the result); an engine that runs no int8 never gets one.
        """

    def check(self, precision: str, device: torch.device, *, option: str = "precision") -> None:
        """Raise unless this engine can run ``precision`` on ``device`` here.

        Raises:
            UnsupportedPrecisionError: a device or precision it does not run (the message says what works).
            MissingDependencyError: its optional packages are missing (the message names the pip extra).
        """
        if device.type not in self.devices:
            raise UnsupportedPrecisionError(
                f"the {self.name} engine runs on {', '.join(self.devices)} only, not {device.type}; "
                f"use engine='torch' on {device.type}")
        if precision not in self.precisions:
            raise UnsupportedPrecisionError(
                f"the {self.name} engine does not run {setting(option, precision)}; it runs "
                f"{', '.join(self.precisions)} (engine='torch' or engine='auto' for {precision})")
        for module in self.requires:
            require(module, extra=self.extra, purpose=f"the {self.name} inference engine")

    def available(self, precision: str, device: torch.device) -> bool:
        """Whether :meth:`check` passes (quietly)."""
        try:
            self.check(precision, device)
        except (UnsupportedPrecisionError, InvalidArgumentError, ImportError):  # Invalid: a precision it does not know
            return False
        return True

    def help_line(self) -> str:
        """What ``--help`` says about this engine: its description, devices, precisions and the pip
        extra that installs it, e.g. ``onnxruntime (ONNX Runtime's CPU provider running the onnx
        export's graph; cpu; fp32; extra: export)``."""
        needs = f"; extra: {self.extra}" if self.requires else ""
        return f"{self.name} ({self.description}; {', '.join(self.devices)}; {', '.join(self.precisions)}{needs})"

    def __repr__(self) -> str:
        return f"<inference engine {self.name!r}>"
