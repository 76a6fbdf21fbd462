"""What Triton reads of a model besides its files: the one writer of ``config.pbtxt``, the model's name, ``labels.txt``.

Both model repositories that convnets writes get their ``config.pbtxt`` from :func:`config_text`:
``convnets export --triton`` (:mod:`convnets.deploy.triton.repository`) and ``convnets serve``
(:mod:`convnets.serve.repository`). It fills Triton's ``ModelConfig`` protobuf (the module that
tritonclient ships; the ``triton`` extra) and prints it in protobuf's text format, so any name is
escaped as the format requires and the file parses back as the message that was built.
Reference: https://github.com/triton-inference-server/server/blob/main/docs/user_guide/model_configuration.md
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from convnets.errors import InvalidArgumentError
from convnets.fileio import write_output
from convnets.text import printable

__all__ = ["TensorConfig", "check_model_name", "config_text", "model_config_pb2", "write_labels"]

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def check_model_name(name: str) -> str:
    """Return ``name`` if it is usable as a Triton model (directory) name, else raise InvalidArgumentError."""
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidArgumentError(f"invalid Triton model name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def model_config_pb2() -> ModuleType:
    """tritonclient's ``model_config_pb2`` (Triton's ``ModelConfig`` protobuf).

    Raises:
        MissingDependencyError: tritonclient (with its grpc part) is not installed; the message names the extra.
    """
    from convnets.deploy.formats.base import require

    return require("tritonclient.grpc.model_config_pb2", extra="triton", purpose="writing a Triton model config")


@dataclass(frozen=True)
class TensorConfig:
    """One input or output of a model's config.

    Attributes:
        name: the tensor's name.
        data_type: Triton's type without ``TYPE_``: ``"FP32"``, ``"INT64"``, ``"STRING"`` (bytes).
        dims: the shape of one batch item (the batch axis is implicit: ``max_batch_size`` > 0).
        nchw: images in NCHW (``format: FORMAT_NCHW``).
        labels: the class names of its columns are in ``labels.txt`` (``label_filename``).
    """

    name: str
    data_type: str
    dims: Sequence[int]
    nchw: bool = False
    labels: bool = False


def config_text(name: str, *, max_batch_size: int, inputs: Sequence[TensorConfig], outputs: Sequence[TensorConfig],
                max_queue_delay_us: int, platform: str | None = None, backend: str | None = None,
                instance_kind: str | None = None, instance_count: int = 0,
                parameters: Mapping[str, str] | None = None, header: str = "") -> str:
    """The text of ``config.pbtxt``: Triton's ``ModelConfig`` in protobuf text format.

    Args:
        name: the model's name (its directory's; checked by :func:`check_model_name`).
        max_batch_size: the largest batch Triton forms (dynamic batching is on).
        inputs, outputs: the tensors.
        max_queue_delay_us: how long a request may wait for others to batch with.
        platform, backend: what runs the model: a ``platform`` (``onnxruntime_onnx``) or a ``backend``
            (``openvino``, ``python``); one of them.
        instance_kind: the model instances' ``kind`` (``"KIND_CPU"``), or None: Triton's default.
        instance_count: instances of that kind (0: Triton's default).
        parameters: the config's string ``parameters``, which the model (and any client) reads.
        header: comment lines put before the message (``#`` added).

    Returns:
        The configuration text.
    """
    from google.protobuf import text_format

    pb = model_config_pb2()
    config = pb.ModelConfig(name=check_model_name(name), max_batch_size=max_batch_size)
    if platform:
        config.platform = platform
    if backend:
        config.backend = backend
    for tensors, field in ((inputs, config.input), (outputs, config.output)):
        for tensor in tensors:
            added = field.add(name=tensor.name, data_type=pb.DataType.Value(f"TYPE_{tensor.data_type}"),
                              dims=list(tensor.dims))
            if tensor.nchw:
                added.format = pb.ModelInput.FORMAT_NCHW
            if tensor.labels:
                added.label_filename = "labels.txt"
    config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us
    if instance_kind:
        group = config.instance_group.add(kind=pb.ModelInstanceGroup.Kind.Value(instance_kind))
        if instance_count:
            group.count = instance_count
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + text_format.MessageToString(config, as_utf8=True)


def write_labels(model_dir: Path, labels: Sequence[str], *, force: bool = False, base: Path | None = None) -> Path:
    """Write ``model_dir/labels.txt``, one class name per line (what ``label_filename`` names), as
    :func:`convnets.fileio.write_output` writes (``force``: replace it; ``base``: the repository): a line per
    class, whatever the names hold. Triton reads a line per class, so a name with a line break or another
    control character is written :func:`~convnets.text.printable` (``"a\\nb"`` as ``a\\nb``); the
    model config's ``labels`` parameter of ``convnets serve`` keeps the names as they are.

    Returns:
        The file written.
    """
    text = "".join(f"{printable(label)}\n" for label in labels)
    return write_output(model_dir / "labels.txt", lambda f: f.write(text.encode("utf-8")), force=force, base=base)
