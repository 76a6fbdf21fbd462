"""The model repository that ``convnets serve`` hands to Triton: one Python-backend model around a classifier.

Layout (Triton's model repository; the backend is :mod:`convnets.serve.backend`)::

    DIR/<name>/config.pbtxt     backend "python", the tensors below, dynamic batching, parameters
    DIR/<name>/labels.txt       class names (Triton's classification extension: label_filename)
    DIR/<name>/served.json      what the backend loads and how it runs (:class:`ServedModel`)
    DIR/<name>/1/model.py       a few lines: the model is convnets.serve.backend's

The model's interface (KServe v2 / Open Inference Protocol; N images per request, up to
``max_batch_size``):

* input ``image``: ``BYTES`` ``[N, 1]``, each element an encoded image file (JPEG, PNG, ...),
  decoded and preprocessed as ``convnets predict`` does;
* output ``probabilities``: ``FP32`` ``[N, classes]``, softmax of the logits;
* outputs ``top_labels`` (``BYTES``), ``top_indices`` (``INT64``) and ``top_probabilities``
  (``FP32``), each ``[N, topk]``, best first;
* output ``embedding`` (with ``embedding=True``): ``FP32`` ``[N, features]``, the pooled ``layer4``
  features, whose classifier gives the logits.

A multi-label model (``convnets train --multilabel``) answers with a sigmoid per class in
``probabilities`` and ``top_probabilities``, and has one output more:

* ``labels``: ``BYTES`` ``[N, classes]``, the names of the classes whose probability reaches their
  threshold, most probable first, then empty strings (``convnets predict``'s ``labels``).

The config's ``parameters`` name the model, its weights (the checkpoint's file name, never its
directory), engine and precision, and hold the class names as a JSON list (``labels``) and, for a
multi-label model, its thresholds (``thresholds``, a JSON list), so a client reads them with
``get_model_config``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convnets.deploy.triton.config import TensorConfig, check_model_name, config_text, write_labels
from convnets.errors import InvalidArgumentError
from convnets.runtime import PrecisionName

__all__ = ["BACKEND_MODULE", "INPUT", "OUTPUTS", "SERVED_FILE", "ServedModel", "model_config", "write_repository"]

#: The input tensor: encoded image files.
INPUT = "image"
#: The output tensors (``embedding`` only when asked for).
OUTPUTS: tuple[str, ...] = ("probabilities", "top_labels", "top_indices", "top_probabilities", "labels", "embedding")
#: Where the backend finds its :class:`ServedModel`, in the model's directory.
SERVED_FILE = "served.json"
#: The module whose ``TritonPythonModel`` the repository's ``model.py`` re-exports.
BACKEND_MODULE = "convnets.serve.backend"



def _model_py() -> str:
    """The repository's ``model.py``: the backend of the convnets that writes it (the same files)."""
    root = str(Path(__file__).resolve().parents[2])
    return f'''"""Written by `convnets serve`: the model is {BACKEND_MODULE}'s (it reads ../{SERVED_FILE})."""
import sys

# Triton's Python backend ignores PYTHONPATH: import the convnets of the server that wrote this.
if {root!r} not in sys.path:
    sys.path.insert(0, {root!r})
from {BACKEND_MODULE} import TritonPythonModel  # noqa: E402, F401
'''


@dataclass(frozen=True)
class ServedModel:
    """What the backend loads and how it runs it: ``served.json`` in the repository.

    Attributes:
        name: the Triton model name (the URL path ``/v2/models/<name>``).
        model: the registered architecture (:func:`convnets.registry.choose_model`'s ``name``).
        weights: a checkpoint's absolute path; ``None``: ``pretrained`` or random weights.
        pretrained: NVIDIA's weights (without ``weights``).
        arch_kwargs: architecture overrides of random weights.
        image_size: the center crop (the resize scales with it, as ``convnets predict`` does).
        engine, precision, device, cache: as for :func:`convnets.optimize_for_inference`.
        fast_decode: decode large JPEGs at a reduced DCT scale first (``--fast-decode``).
        decode: where JPEGs are decoded (``--decode``): ``auto``, ``cpu`` or ``device``, as for ``convnets predict``.
        topk: classes in the ``top_*`` outputs.
        embedding: also output the pooled ``layer4`` features.
        threads: PyTorch's intra-op threads and the decoding threads of the model instance.
        max_batch_size: the most images Triton puts in one execution (and accepts in one request).
        max_queue_delay_us: how long a request may wait for others to batch with.
        max_image_bytes: the largest encoded image accepted.
        labels: the class names, one per output of ``probabilities``.
        num_features: the length of ``embedding``.
        thresholds: a multi-label model's per-class thresholds (sigmoid probabilities and the ``labels``
            output); ``None``: a single-label model (softmax).
    """

    name: str
    model: str
    weights: str | None
    pretrained: bool
    image_size: int
    engine: str
    precision: PrecisionName
    device: str
    topk: int
    threads: int
    max_batch_size: int
    max_queue_delay_us: int
    max_image_bytes: int
    labels: tuple[str, ...]
    num_features: int
    arch_kwargs: Mapping[str, Any] = field(default_factory=dict)
    cache: bool = True
    fast_decode: bool = False
    embedding: bool = False
    decode: str = "auto"
    thresholds: tuple[float, ...] | None = None

    def outputs(self) -> tuple[str, ...]:
        """The output tensors this model has."""
        return tuple(o for o in OUTPUTS if (o != "embedding" or self.embedding)
                     and (o != "labels" or self.thresholds is not None))

    def to_json(self) -> str:
        """The settings as JSON (:meth:`from_json` reads them back)."""
        return json.dumps(dataclasses.asdict(self), indent=2, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> ServedModel:
        """Settings written by :meth:`to_json`."""
        values = json.loads(text)
        values["labels"] = tuple(values["labels"])
        if values.get("thresholds") is not None:
            values["thresholds"] = tuple(values["thresholds"])
        return cls(**values)


def model_config(served: ServedModel) -> str:
    """The text of ``config.pbtxt`` (Triton's ``ModelConfig`` in protobuf text format), written by
    :func:`convnets.deploy.triton.config.config_text`, so that any class name or path is escaped as the
    format requires."""
    classes, k = len(served.labels), served.topk
    shapes = {"probabilities": ("FP32", classes), "top_labels": ("STRING", k), "top_indices": ("INT64", k),
              "top_probabilities": ("FP32", k), "labels": ("STRING", classes), "embedding": ("FP32", served.num_features)}
    outputs = [TensorConfig(name, shapes[name][0], [shapes[name][1]], labels=name == "probabilities")
               for name in served.outputs()]
    # The checkpoint's file name only: the config is every client's to read, the directories are not.
    weights = Path(served.weights).name if served.weights else ("pretrained" if served.pretrained else "random-init")
    parameters = {"model": served.model, "weights": weights, "engine": served.engine, "precision": served.precision,
                  "image_size": str(served.image_size), "topk": str(served.topk),
                  "labels": json.dumps(served.labels, ensure_ascii=False)}
    if served.thresholds is not None:
        parameters["thresholds"] = json.dumps(list(served.thresholds))
    # One instance: its PyTorch threads use the cores; a second instance would share them with it.
    return config_text(served.name, backend="python", max_batch_size=served.max_batch_size,
                       inputs=[TensorConfig(INPUT, "STRING", [1])], outputs=outputs,
                       max_queue_delay_us=served.max_queue_delay_us, instance_kind="KIND_CPU", instance_count=1,
                       parameters=parameters,
                       header="Written by `convnets serve`: a convnets classifier on Triton's Python backend.")


def write_repository(directory: str | Path, served: ServedModel) -> Path:
    """Write the repository for ``served`` into ``directory`` (which must exist).

    Returns:
        The model's directory, ``directory/<name>``.

    Raises:
        InvalidArgumentError: a bad model name, ``topk`` above the number of classes.
    """
    if not 1 <= served.topk <= len(served.labels):
        raise InvalidArgumentError(f"topk must be from 1 to the model's {len(served.labels)} classes, "
                                   f"got {served.topk}")
    model_dir = Path(directory) / check_model_name(served.name)
    (model_dir / "1").mkdir(parents=True)
    write_labels(model_dir, served.labels)
    (model_dir / SERVED_FILE).write_text(served.to_json(), encoding="utf-8")
    (model_dir / "config.pbtxt").write_text(model_config(served), encoding="utf-8")
    (model_dir / "1" / "model.py").write_text(_model_py(), encoding="utf-8")
    return model_dir

