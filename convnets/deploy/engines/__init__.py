"""Inference engines behind ``optimize_for_inference(engine=NAME)`` and ``convnets benchmark --engine``.

Each engine is one module here with an :class:`~convnets.deploy.engines.base.Engine` subclass and
a module-level ``ENGINE`` instance, registered like the export formats
(:mod:`convnets.deploy.formats`): adding a built-in engine is that module plus its name in
:data:`ENGINES` (a :class:`~convnets.plugins.Registry`); other code can add one with
:func:`register_engine` or the ``@ENGINES.plugin`` class decorator. The engine's class
attributes (description, devices, precisions, extra) are its documentation: ``--engine``'s choices
and help (``convnets predict --help``, ``convnets benchmark --help``) come from :func:`engines`.
Engine modules import nothing heavy until they build (see :mod:`convnets.deploy.engines.base`), so
listing them costs no PyTorch import.

``engine="auto"`` (:func:`build_auto`) tries the engines of :data:`AUTO_ORDER` for the device and
precision, in order, and takes the first one that is installed, builds, and passes the
faithfulness check of exports on their example photos (fp32: 1e-4 relative; bf16/fp16: per-sample
cosine >= 0.99; the result is kept in the engine cache with the converted graph,
:mod:`convnets.deploy.cache`, so a later process with the same model skips both); ``torch`` ends every order and is taken without a check (it is the reference path).
int8 is checked instead on calibration images held out of the quantizer's calibration (top-1
agreement >= 99%, :func:`check_int8`), and since the torch engine runs no int8, ``auto`` raises when no int8 engine passes.

Importing this package loads no PyTorch and no engine module; :func:`engines` loads the engine
modules, still without PyTorch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from convnets.deploy.cache import entry_of
from convnets.deploy.engines.base import DEFAULT_SETTINGS, Engine, EngineSettings
from convnets.errors import UnsupportedPrecisionError
from convnets.plugins import Registry
from convnets.runtime import setting

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from convnets.deploy.export import Verification

__all__ = ["AUTO", "AUTO_ORDER", "ENGINES", "Engine", "EngineSettings", "auto_order", "available_engines", "build_auto",
           "check_int8", "engine_names", "engines", "get_engine", "register_engine"]

log = logging.getLogger(__name__)
# auto's choice, one line per built model: a logger of its own, so that the command line can show
# this line by default (convnets.cli) while the rest of the INFO output waits for -v.
CHOICE_LOG = logging.getLogger("convnets.auto")

#: The name that asks for :func:`build_auto`'s choice.
AUTO = "auto"

#: ``engine="auto"``: engines to try, fastest first, per (device type, precision); ``torch`` is
#: always last (see :func:`auto_order`). The order is the one benchmarks/bench_engines.py measures
#: (its results: benchmarks/results/bench_engines.json, the Benchmarks page's engine tables): on
#: the CPU, OpenVINO first or level with the rest in fp32 and bf16. Engines are timed with a pause
#: between them (benchmarks/interleave.py): a previous runtime's spinning threads otherwise count.
#: Non-CPU devices: ``torch`` only (the other engines run on the CPU here).
AUTO_ORDER: dict[tuple[str, str], tuple[str, ...]] = {
    ("cpu", "fp32"): ("openvino", "onnxruntime", "torch"),
    ("cpu", "bf16"): ("openvino", "torch"),
    ("cpu", "int8"): ("openvino",),  # NNCF; the torch engine runs no int8: auto raises when this one fails
}

#: Every inference engine: the built-in ones are this package's modules, each with its ``ENGINE``.
ENGINES: Registry[Engine] = Registry("inference engine", Engine, package=__name__,
                                     builtin={"torch": "torch", "onnxruntime": "onnxruntime",
                                              "openvino": "openvino"}, attribute="ENGINE")


def register_engine(engine: Engine) -> Engine:
    """Add ``engine`` to the registry under ``engine.name`` and return it (:meth:`Registry.register`)."""
    return ENGINES.register(engine)


def engine_names() -> tuple[str, ...]:
    """Every registered engine's name, built-in ones first (imports none of them)."""
    return ENGINES.names()


def engines() -> tuple[Engine, ...]:
    """Every registered engine, in :func:`engine_names`' order (engine modules are light: no PyTorch)."""
    return ENGINES.all()


def get_engine(name: str, *, option: str = "engine") -> Engine:
    """The registered engine called ``name``.

    Raises:
        InvalidArgumentError: no such engine (the message lists them and ``auto``).
    """
    return ENGINES.get(name, label=setting(option, name), also=(AUTO,))


def available_engines(precision: str, device: torch.device) -> tuple[str, ...]:
    """The registered engines that are installed and run ``precision`` on ``device``."""
    return tuple(engine.name for engine in ENGINES.all() if engine.available(precision, device))


def auto_order(precision: str, device: torch.device) -> tuple[str, ...]:
    """The engines ``engine="auto"`` tries, in order (:data:`AUTO_ORDER`, ``torch`` last)."""
    order = AUTO_ORDER.get((device.type, precision), ())
    return (*(name for name in order if name != "torch"), "torch")


def build_auto(model: nn.Module, precision: str, device: torch.device, *, compile: bool,
               settings: EngineSettings = DEFAULT_SETTINGS,
               calibration_data: list[torch.Tensor] | None = None, held_out: torch.Tensor | None = None) -> nn.Module:
    """``engine="auto"``: the first engine of :func:`auto_order` that is installed, builds and is faithful.

    Each candidate other than ``torch`` is built and checked against ``model`` on the example photos
    that verify exports, at the model's input size (and on the first alone), with the export criterion
    (:func:`convnets.deploy.export.verify_runner`); one that is missing, fails to build or
    disagrees is skipped with a log line. The choice is logged once, at INFO. Each candidate is
    built with ``settings``.

    int8 (``calibration_data`` and ``held_out`` given, as :func:`~convnets.deploy.calibrate.split_calibration`
    returns them) is calibrated on the first and checked on the second instead (top-1 agreement
    >= 99%, :func:`check_int8`): no engine stands in for it, so when none qualifies this raises.

    Raises:
        UnsupportedPrecisionError: int8, and no engine that runs it is installed and faithful.
    """
    from convnets.deploy.cache import recorded_verdict
    from convnets.deploy.export import sample_batch, verify_runner
    from convnets.deploy.folding import error_summary

    int8 = precision == "int8"
    # fp32 / bf16 / fp16: the photos that verify exports (shipped in the package), at the model's input size.
    size = int(getattr(model, "input_size", 224))
    batch, inputs = (None, "") if int8 else sample_batch(image_size=size)
    reasons = []
    cached: Verification | None = None
    for name in auto_order(precision, device):
        engine = get_engine(name)
        if name == "torch":
            if int8:
                reasons.append("torch runs no int8")
                continue
            built = engine.build(model, precision, device, compile=compile, settings=settings)
            break
        if not engine.available(precision, device):
            log.debug("engine='auto': %s is not installed or does not run %s on %s", name, precision, device)
            reasons.append(f"{name} does not run {precision} here")
            continue
        earlier = None if int8 else _cached_check(recorded_verdict(model, engine=name, precision=precision,
                                                                   shape=(3, size, size), runtimes=engine.requires))
        if earlier is not None and not earlier.passed:
            # Warned about when it was checked; not loaded again only to be rejected.
            log.info("engine='auto': skipping %s, which disagreed with the model when it was checked "
                     "(engine cache)", name)
            reasons.append(f"{name} disagreed with the model (its check read from the engine cache)")
            continue
        try:
            built = engine.build(model, precision, device, compile=compile, settings=settings,
                                 calibration_data=calibration_data if int8 else None)
            entry = entry_of(built)  # an engine-cache entry that may hold this check's earlier result
            cached = _cached_check(entry.verdict()) if entry is not None else None
            if cached is not None:
                check = cached
            else:
                check = (check_int8(built, model, held_out) if batch is None
                         else verify_runner(built, model, batch, precision, inputs))
                if entry is not None:
                    entry.record_verdict(check.to_dict())
        except Exception as e:  # noqa: BLE001 - any engine failure: try the next engine
            log.warning("engine='auto': %s failed (%s); trying the next engine", name, error_summary(e))
            reasons.append(f"{name} failed ({error_summary(e)})")
            continue
        if check.passed:
            if int8:
                setattr(built, "calibration_check", check)  # a plain attribute (Module's typed setattr: tensors)
            break
        log.warning("engine='auto': %s disagrees with the model (max relative error %.3g, min cosine %.5f, "
                    "top-1 agreement %.1f%%; required %s); trying the next engine", name, check.max_rel_error,
                    check.min_cosine, 100 * check.top1_agreement, check.tolerance)
        reasons.append(f"{name} agreed with the model's top-1 class on {100 * check.top1_agreement:.1f}% of "
                       f"{check.inputs} (required {check.tolerance})")
    else:
        raise UnsupportedPrecisionError(f"engine='auto' found no engine that runs precision={precision!r} faithfully: "
                                        f"{'; '.join(reasons)}; use precision='bf16' (or 'fp32')")
    CHOICE_LOG.info("engine='auto' picked %s for %s on %s%s", built.engine, precision, device,
             " (its check read from the engine cache)" if built.engine != "torch" and cached is not None else "")
    return built


def _cached_check(verdict: dict[str, object] | None) -> Verification | None:
    """The :class:`~convnets.deploy.export.Verification` that an engine-cache entry recorded; ``None``
    when there is none or it is not one (checked again and recorded anew, never trusted as it is)."""
    from convnets.deploy.export import Verification

    try:
        return None if verdict is None else Verification.from_dict(verdict)
    except ValueError:
        return None


def check_int8(built: nn.Module, model: nn.Module, images: torch.Tensor | None) -> Verification:
    """How an int8 ``built`` compares with ``model`` on ``images``, held out of its calibration.

    The criterion is :func:`convnets.deploy.export.verify_runner`'s for int8: top-1 agreement
    >= 99%. Both run 32 images at a time.
    """
    import torch

    from convnets.deploy.export import verify_runner

    if images is None:
        raise ValueError("int8 is checked on held-out images (convnets.deploy.calibrate.split_calibration)")

    def chunked(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.cat([run(part) for part in x.split(32)])
    return verify_runner(chunked(built), chunked(model), images, "int8",  # type: ignore[arg-type]
                         f"{len(images)} calibration images held out of the calibration")

