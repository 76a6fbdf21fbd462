"""OpenVINO IR (``model.xml`` graph + ``model.bin`` weights): for OpenVINO Runtime and Triton's openvino backend.

The graph comes from ``torch.export`` (the same capture as the AOTInductor format), converted with
``openvino.convert_model``. That path was chosen over the two others that work here:
``convert_model(module, example_input=...)`` traces with ``torch.jit.trace``, which is deprecated
and warns on every call, and converting the ONNX file would need the ``export`` extra's onnx and
the TorchScript-based ONNX exporter (deprecated as well). The input shape is declared as
``[-1, 3, H, W]``: a dynamic batch axis and the fixed image size, so Triton's ``dims`` match.

References: https://docs.openvino.ai/2025/openvino-workflow/model-preparation/convert-model-pytorch.html ,
https://github.com/triton-inference-server/openvino_backend
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.deploy.formats.base import ExportFormat, Runner, require

if TYPE_CHECKING:
    from torch import Tensor, nn

#: OpenVINO's CPU plugin computes in bf16 by default on CPUs that have it (AVX512-BF16, AMX), which
#: moves fp32 logits by ~5e-3 relative (measured here), too far for the 1e-4 check; verification
#: asks for f32 explicitly.
VERIFY_CONFIG = {"INFERENCE_PRECISION_HINT": "f32"}

_core: Any = None
_core_lock = threading.Lock()


def core() -> Any:
    """The process's one ``openvino.Core``, with its CPU plugin loaded; every compile here goes through it.

    OpenVINO's CPU plugin (2026.4) gives the thread that loads it an alternate signal stack and puts
    back the one it found when its Core goes away. With a Core per compiled model, Cores released
    in the order they were made (not the reverse) left the thread's alternate stack pointing at
    freed memory, and the next signal handled in Python (SIGINT, a SIGCHLD handler, ...) killed the
    process with SIGSEGV: in this package's tests, a later ``torch.compile``'s compiler subprocess.
    One Core, kept for the life of the process, never puts a stack back (tests/test_engines.py
    ``test_signals_are_still_handled_after_openvino_models_are_released``).

    Reference: https://github.com/openvinotoolkit/openvino/pull/11894 (the plugin's signal stack).
    """
    global _core
    with _core_lock:
        if _core is None:
            ov = require("openvino", extra="openvino", purpose="OpenVINO Runtime")
            made = ov.Core()
            made.get_property("CPU", "FULL_DEVICE_NAME")  # loads the CPU plugin now, before any other Core
            _core = made
        return _core


class CompiledRunner:
    """An ``openvino.CompiledModel`` as a runner; ``compiled`` is that model (``compiled.get_property(NAME)``:
    the properties it runs with)."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def __call__(self, batch: Tensor) -> Tensor:
        import torch

        # share_outputs is False by default: the array is a copy, not the request's buffer.
        return torch.from_numpy(self.compiled(batch.contiguous().numpy())[0]).float()


class OpenVinoFormat(ExportFormat):
    """OpenVINO IR with a dynamic batch axis, checked with OpenVINO Runtime on the CPU in f32."""

    name = "openvino"
    description = "OpenVINO IR, model.xml + model.bin: OpenVINO Runtime, Triton openvino backend"
    file_names = ("model.xml", "model.bin")
    input_name = "input"
    output_name = "output"
    runtime = "OpenVINO Runtime (CPU, f32)"
    triton_backend = "openvino"
    triton_instance_kind = "KIND_CPU"  # the backend runs on the CPU only
    triton_python_runtime = "openvino"
    extra = "openvino"
    requires = ("openvino",)

    def write(self, module: nn.Module, path: Path, example: Tensor) -> None:
        ov = require("openvino", extra=self.extra, purpose="the openvino export")
        # save_model stores fp16 weights by default; fp32 exports keep fp32 weights (fp16 exports
        # already have them in the graph).
        ov.save_model(self.convert(module, example), str(path), compress_to_fp16=False)

    def convert(self, module: nn.Module, example: Tensor) -> Any:
        """``module`` as an in-memory ``openvino.Model`` with a dynamic batch axis (what :meth:`write` saves).

        Also what the openvino inference engine (:mod:`convnets.deploy.engines.openvino`) compiles.
        """
        from convnets.deploy.formats.aoti import export_program

        ov = require("openvino", extra=self.extra, purpose="the openvino export")
        program = export_program(module, example)
        model = ov.convert_model(program, input=[ov.PartialShape([-1, *example.shape[1:]])])
        # Names as in the ONNX export (and Triton's config), instead of torch.export's node names.
        model.inputs[0].get_tensor().set_names({self.input_name})
        model.outputs[0].get_tensor().set_names({self.output_name})
        return model

    def compile(self, model: Any, config: Mapping[str, Any]) -> Runner:
        """A runner for an ``openvino.Model`` or IR file compiled for the CPU with ``config``.

        Args:
            model: what :meth:`convert` returns, or the path of ``model.xml`` (``model.bin`` beside it).
            config: OpenVINO CPU properties, e.g. :data:`VERIFY_CONFIG`.

        Returns:
            A :class:`CompiledRunner`.
        """
        return CompiledRunner(core().compile_model(model if not isinstance(model, Path) else str(model), "CPU",
                                                   dict(config)))

    def load_runner(self, path: Path) -> Runner:
        return self.compile(path, VERIFY_CONFIG)

    def triton_notes(self, *, input_name: str, max_batch_size: int, image_size: int) -> str:
        return f"""
## OpenVINO backend

Triton's [openvino backend](https://github.com/triton-inference-server/openvino_backend) reads
`1/model.xml` (its default file name) with `1/model.bin` beside it, and runs on the CPU only:
hence `instance_group [ {{ kind: KIND_CPU }} ]` in `config.pbtxt` (the server needs no `--gpus`).
The IR's batch axis is dynamic (`[?, 3, {image_size}, {image_size}]`), which the backend uses for
batches up to `max_batch_size` ({max_batch_size}). (No Triton server was run where this was
written: this configuration is checked against Triton's ModelConfig schema and the IR, not served;
`--triton-backend python` writes a variant that the Triton of convnets' `serve` extra serves.)

OpenVINO computes in bfloat16 by default on CPUs that support it (AVX512-BF16, AMX): faster, but
the logits then move away from the fp32 ones verified here (by about 5e-3 relative on a small
network, measured where this package was written); `convnets export` verifies with
`INFERENCE_PRECISION_HINT=f32`. Add
`parameters {{ key: "PERFORMANCE_HINT" value {{ string_value: "LATENCY" }} }}` (or `"THROUGHPUT"`)
to tune it for your clients (see the backend's README).
"""


FORMAT = OpenVinoFormat()
