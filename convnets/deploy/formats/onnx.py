"""ONNX: for ONNX Runtime, TensorRT (``trtexec --onnx``) and Triton's ``onnxruntime_onnx`` platform.

References: https://pytorch.org/docs/stable/onnx_torchscript.html ,
https://onnxruntime.ai/docs/api/python/api_summary.html
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.deploy.formats.base import ExportFormat, FormatOption, Runner, Signature, quiet_export_warnings, require
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    from torch import Tensor, nn

MIN_OPSET = 17


def _check_opset(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_OPSET:
        raise InvalidArgumentError(f"opset must be an integer, {MIN_OPSET} or newer; got {value!r}")
    return value


class SessionRunner:
    """An ONNX Runtime session as a runner; ``session`` is the ``onnxruntime.InferenceSession``
    (``session.get_session_options()``: the settings it runs with)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.input_name = session.get_inputs()[0].name

    def __call__(self, batch: Tensor) -> Tensor:
        import torch

        return torch.from_numpy(self.session.run(None, {self.input_name: batch.numpy()})[0]).float()


class OnnxFormat(ExportFormat):
    """A static ONNX graph (TorchScript-based exporter), checked with ``onnx.checker``, run with ONNX Runtime."""

    name = "onnx"
    description = "ONNX Runtime, TensorRT, Triton onnxruntime_onnx"
    file_names = ("model.onnx",)
    input_name = "input"
    output_name = "output"
    runtime = "ONNX Runtime"
    triton_platform = "onnxruntime_onnx"
    triton_python_runtime = "onnxruntime"
    requires = ("onnx", "onnxruntime")
    options = (FormatOption("opset", int, MIN_OPSET, f"ONNX opset ({MIN_OPSET} or newer)", _check_opset),)

    def write(self, module: nn.Module, path: Path, example: Tensor, *, opset: int = MIN_OPSET) -> None:
        import torch

        onnx = require("onnx", purpose="the onnx export")
        with quiet_export_warnings():
            # dynamo=False: the TorchScript-based exporter, which needs no onnxscript and produces a
            # plain static graph (BatchNorm already folded, so no training-mode branches).
            torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=opset,
                              input_names=[self.input_name], output_names=[self.output_name],
                              dynamic_axes={self.input_name: {0: "batch"}, self.output_name: {0: "batch"}},
                              do_constant_folding=True)
        onnx.checker.check_model(str(path))

    def load_runner(self, path: Path, settings: Mapping[str, Any] | None = None) -> Runner:
        """An ONNX Runtime CPU session for ``path``.

        Args:
            path: the ``.onnx`` file.
            settings: ``onnxruntime.SessionOptions`` attributes to set, e.g. ``intra_op_num_threads``,
                ``graph_optimization_level`` (a ``GraphOptimizationLevel`` or its name, e.g.
                ``"ORT_ENABLE_EXTENDED"``), ``execution_mode`` (likewise, e.g. ``"ORT_PARALLEL"``), or
                session configuration entries (a dotted key, e.g. ``session.intra_op.allow_spinning``);
                default: ONNX Runtime's defaults (benchmarks/bench_engines.py ``--settings`` compares them).
        """
        import torch

        ort = require("onnxruntime", purpose="the onnx export")
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only
        for key, value in (settings or {}).items():
            if "." in key:  # a session configuration entry, e.g. session.intra_op.allow_spinning=0
                options.add_session_config_entry(key, str(value))
                continue
            if isinstance(value, str) and value.startswith("ORT_"):
                kind = ort.GraphOptimizationLevel if key == "graph_optimization_level" else ort.ExecutionMode
                value = getattr(kind, value)
            setattr(options, key, value)
        return SessionRunner(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))

    def signature(self, path: Path, runner: Runner, example: Tensor) -> Signature:
        # Read back from the file, so that what we report (and put into Triton's config) is what
        # the graph declares; the dynamic batch axis is a symbolic dimension.
        graph = require("onnx", purpose="the onnx export").load(str(path), load_external_data=False).graph

        def dims(value_info: Any) -> tuple[int, ...]:
            return tuple(d.dim_value if d.HasField("dim_value") else -1
                         for d in value_info.type.tensor_type.shape.dim)
        return graph.input[0].name, dims(graph.input[0]), graph.output[0].name, dims(graph.output[0])

    def triton_notes(self, *, input_name: str, max_batch_size: int, image_size: int) -> str:
        opt = min(16, max_batch_size)
        shape = f"3x{image_size}x{image_size}"
        return f"""
## TensorRT

The same ONNX file builds a TensorRT engine (on the GPU that will run it; none was built here):

    trtexec --onnx=1/model.onnx --minShapes={input_name}:1x{shape} \\
            --optShapes={input_name}:{opt}x{shape} --maxShapes={input_name}:{max_batch_size}x{shape} \\
            --fp16 --saveEngine=model.plan

Serve it with `platform: "tensorrt_plan"` and `1/model.plan` instead of `model.onnx` (same names and dims),
or keep ONNX Runtime and let it use TensorRT inside Triton:
`optimization {{ execution_accelerators {{ gpu_execution_accelerator: [ {{ name: "tensorrt" }} ] }} }}`.
"""


FORMAT = OnnxFormat()
