"""The ``openvino`` engine: the OpenVINO conversion of the folded model (as the openvino export
format makes it, :mod:`convnets.deploy.formats.openvino`), saved as IR in the engine cache
(:mod:`convnets.deploy.cache`) and compiled from there for the CPU plugin (int8: in memory, uncached).

OpenVINO's CPU plugin computes in bf16 by default on CPUs that have it, so the precision is
always stated: ``INFERENCE_PRECISION_HINT`` ``f32`` for fp32 (within 1e-4 of the model) or
``bf16``. ``PERFORMANCE_HINT`` is left at OpenVINO's default (LATENCY: one stream using every core).

``int8``: NNCF post-training quantization (:func:`quantize_int8`) of that same ``openvino.Model``,
calibrated on images the caller gives (``calibration_data``): int8 weights per output channel and
int8 activations, with the layers that stay in float (those NNCF leaves unquantized) computed in
f32. Calibration fixes the image size: the int8 graph runs batches of any size at the calibration
images' height and width only.

References: https://docs.openvino.ai/2025/openvino-workflow/running-inference/optimize-inference/precision-control.html ,
https://docs.openvino.ai/2025/openvino-workflow/model-optimization-guide/quantizing-models-post-training/basic-quantization-flow.html
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from convnets.deploy.engines.base import DEFAULT_SETTINGS, Engine, EngineSettings
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from convnets.deploy.formats import Runner

log = logging.getLogger(__name__)

#: OpenVINO's name of each precision this engine runs (int8: the float layers left around the
#: quantized ones; f32 measured as fast as bf16 there, and closer to the model).
PRECISION_HINTS: dict[str, str] = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}


class OpenVinoEngine(Engine):
    """OpenVINO Runtime on the CPU, fp32, bf16 or int8 (NNCF post-training quantization)."""

    name = "openvino"
    description = "OpenVINO Runtime, the model converted in memory (int8: NNCF quantization)"
    devices = ("cpu",)
    precisions = tuple(PRECISION_HINTS)
    requires = ("openvino",)
    extra = "openvino"

    def config(self, precision: str) -> dict[str, str]:
        """The CPU plugin's properties for ``precision``."""
        return {"INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision]}

    def check(self, precision: str, device: torch.device, *, option: str = "precision") -> None:
        super().check(precision, device, option=option)
        if precision == "int8":
            from convnets.deploy.formats.base import require

            require("nncf", extra=self.extra, purpose="int8 quantization (NNCF)")

    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool,
              settings: EngineSettings = DEFAULT_SETTINGS, calibration_data: list[Tensor] | None = None) -> nn.Module:
        """See :meth:`Engine.build`.

        Args:
            settings: its ``runtime_options("openvino")`` are CPU plugin properties over
                :meth:`config`'s (``threads``: ``INFERENCE_NUM_THREADS``; through ``runtime``:
                ``PERFORMANCE_HINT``, ``NUM_STREAMS``, ``ENABLE_CPU_PINNING``, ...); OpenVINO's own
                defaults for the rest (benchmarks/bench_engines.py ``--settings`` compares them).
            calibration_data: int8 only (required there): what
                :func:`~convnets.deploy.calibrate.split_calibration` keeps for calibration.
        """
        import torch

        from convnets.deploy.cache import cached_runner
        from convnets.deploy.engines.runner import engine_model, folded_copy, lazy_folded_copy
        from convnets.deploy.formats import get_format
        from convnets.deploy.formats.openvino import OpenVinoFormat

        fmt = get_format("openvino")
        assert isinstance(fmt, OpenVinoFormat)  # for its convert and compile
        config = {**self.config(precision), **settings.runtime_options(self.name)}
        if precision != "int8":
            folded = lazy_folded_copy(model)

            def make_runner(shape: tuple[int, ...]) -> Runner:
                # The IR goes to the engine cache (convnets.deploy.cache), compiled from there.
                return cached_runner(model, engine=self.name, precision=precision, shape=shape,
                                     runtimes=self.requires, files=fmt.file_names,
                                     write=lambda d: fmt.write(folded(), d / "model.xml", torch.zeros(2, *shape)),
                                     load=lambda d: fmt.compile(d / "model.xml", config))
            return engine_model(make_runner, engine=self.name, precision=precision, source=model)
        module = folded_copy(model)

        if not calibration_data:
            raise InvalidArgumentError("the openvino engine's int8 needs calibration_data", keyword="calibration_data")
        calibrated = tuple(calibration_data[0].shape[1:])

        def make_int8_runner(shape: tuple[int, ...]) -> Runner:
            if shape != calibrated:
                raise InvalidArgumentError(
                    f"this int8 model was calibrated on {calibrated[1]}x{calibrated[2]} images and runs that size "
                    f"only, not {shape[1]}x{shape[2]}; quantize again with calibration_data of that size",
                    keyword="calibration_data")
            quantized = quantize_int8(fmt.convert(module, torch.zeros(2, *shape)), calibration_data)
            return fmt.compile(quantized, config)
        return engine_model(make_int8_runner, engine=self.name, precision=precision, source=model,
                            shape=calibrated)


def quantize_int8(ov_model: Any, batches: list[Tensor]) -> Any:
    """``ov_model`` quantized to int8 by NNCF, calibrated on the images of ``batches``.

    NNCF's defaults (``preset`` PERFORMANCE: symmetric int8 weights per output channel, int8
    activations; fast bias correction), fed one image at a time: NNCF counts its calibration
    subset in items, and per-image items keep activation statistics from mixing images.

    Args:
        ov_model: an ``openvino.Model`` (float).
        batches: preprocessed ``[n, 3, H, W]`` float32 CPU batches, every image used (the first
            part of :func:`~convnets.deploy.calibrate.split_calibration`'s answer: at most 300,
            NNCF's default ``subset_size``).

    Returns:
        The quantized ``openvino.Model``.
    """
    from convnets.deploy.formats.base import require
    from convnets.deploy.formats.openvino import core

    core()  # ours first: the Cores NNCF makes for calibration come and go inside its lifetime
    nncf = require("nncf", extra="openvino", purpose="int8 quantization (NNCF)")
    images = [image[None].numpy() for batch in batches for image in batch]
    log.info("int8: NNCF post-training quantization calibrated on %d images", len(images))
    return nncf.quantize(ov_model, nncf.Dataset(images), subset_size=len(images))


ENGINE = OpenVinoEngine()
