"""Triton Python-backend model for an exported graph: ``convnets export --triton --triton-backend python``.

This file is copied as it is into the repository as ``<name>/1/model.py`` (convnets itself never
imports it, and it imports nothing from convnets). Triton's Python backend runs it: it loads the
graph beside it with the runtime that the config's parameters name (``model.onnx`` with ONNX
Runtime, ``model.xml`` with OpenVINO) and answers each batch that Triton's dynamic batcher forms
in one call: float32 NCHW images in, float32 logits out, as the native backends' configs do. It
needs numpy and that runtime in the Python environment of Triton's Python backend: the one that
convnets' ``serve`` extra sets up, where ``convnets serve --repository DIR`` runs it.

As convnets does (``convnets.deploy.telemetry``), the runtimes' third-party telemetry is kept off:
ONNX Runtime's by ``ORT_DISABLE_TELEMETRY=1`` unless set otherwise, OpenVINO's by blocking the
``openvino_telemetry`` module, which OpenVINO treats as optional.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import triton_python_backend_utils as pb_utils

#: The config's ``parameters`` that say what to load (``convnets.deploy.triton.repository`` writes them).
RUNTIME_PARAMETER, FILE_PARAMETER = "runtime", "model_file"


def _load(runtime: str, path: Path) -> Callable[[npt.NDArray[Any]], npt.NDArray[Any]]:
    """The graph at ``path`` as a function from a float32 batch to float32 logits."""
    if runtime == "onnxruntime":
        os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
        session = importlib.import_module("onnxruntime").InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return lambda batch: np.asarray(session.run(None, {name: batch})[0])
    if runtime == "openvino":
        sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]  # None: "not installed"
        openvino = importlib.import_module("openvino")
        # f32: what `convnets export` verified (the CPU plugin would otherwise compute in bf16 where it can).
        compiled = openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        return lambda batch: np.asarray(compiled(batch)[0])
    raise ValueError(f"unknown runtime {runtime!r} in the model's config (onnxruntime or openvino)")


class TritonPythonModel:
    """Triton's Python-backend interface around the exported graph."""

    def initialize(self, args: dict[str, str]) -> None:
        """Load the graph that the config's parameters name, from this version's directory."""
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.input_name = config["input"][0]["name"]
        self.output_name = config["output"][0]["name"]
        folder = Path(args["model_repository"]) / args["model_version"]
        self.run = _load(parameters[RUNTIME_PARAMETER], folder / parameters[FILE_PARAMETER])

    def execute(self, requests: list[Any]) -> list[Any]:
        """One run for the batch: the requests' images concatenated, the logits split back per request."""
        inputs = [pb_utils.get_input_tensor_by_name(r, self.input_name).as_numpy() for r in requests]
        logits = self.run(np.ascontiguousarray(np.concatenate(inputs), dtype=np.float32)).astype(np.float32)
        bounds = np.cumsum([0, *(len(x) for x in inputs)])
        return [pb_utils.InferenceResponse([pb_utils.Tensor(self.output_name, logits[start:end])])
                for start, end in zip(bounds[:-1], bounds[1:])]
