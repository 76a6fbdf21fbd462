"""The model of ``convnets serve``, as Triton's Python backend runs it (in its stub process).

The repository's ``model.py`` (:mod:`convnets.serve.repository`) re-exports :class:`TritonPythonModel`.
``initialize`` loads the model as ``served.json`` says, with the calls ``convnets predict`` makes
(:func:`~convnets.registry.choose_model`, :func:`~convnets.deploy.optimize.optimize_for_inference`
with the engine cache, the model's preprocessing preset). ``execute`` gets the requests that
Triton's dynamic batcher put together: it decodes all their images (on ``threads`` threads), runs
the model once on the images of the requests that decoded, and answers each request with its
outputs, or with one error (HTTP 400, gRPC ``INVALID_ARGUMENT``) naming the image that could not be
used and why. So a bad request costs that request, never the others in its batch or the server.

Triton counts a request answered with an error as a success; the backend counts the requests it
refused in a counter of their own, :data:`REFUSED_METRIC` (a Python-backend metric, on Triton's
``/metrics`` beside Triton's counters, which stay as Triton counts them).

A model that fails to load writes its message to :data:`LOAD_ERROR_FILE` beside ``served.json``,
where :mod:`convnets.serve.server` reads it to say why the server did not start.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.errors import ConvnetsError, message_for
from convnets.serve.repository import INPUT, SERVED_FILE, ServedModel

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

__all__ = ["LOAD_ERROR_FILE", "REFUSED_METRIC", "Classifier", "Decoded", "TritonPythonModel"]

log = logging.getLogger(__name__)

#: Written into the model's directory when loading fails: the reason, in command-line words.
LOAD_ERROR_FILE = "load-error.txt"
#: The counter of requests the model refused, by model and version.
REFUSED_METRIC = "convnets_inference_request_refused"
_BASE64 = re.compile(rb"[A-Za-z0-9+/\s]{16,}={0,2}\s*")
_BASE64_HINT = ("this is base64 text, not an image file: send the file's raw bytes as binary tensor data (what "
                "tritonclient sends by default); the server does not decode base64")


def _is_base64_image(data: bytes) -> bool:
    """Whether ``data`` is base64 text whose decoded start is an image format the server reads."""
    if not _BASE64.fullmatch(data):
        return False
    try:
        head = base64.b64decode(b"".join(data[:4096].split())[:4092], validate=True)
    except (binascii.Error, ValueError):
        return False
    return head.startswith((b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF", b"II*\0", b"MM\0*"))


@dataclass(frozen=True)
class Decoded:
    """A list of encoded images, decoded.

    Attributes:
        tensor: ``[len(rows), 3, H, W]``, the images that decoded.
        rows: position in the list -> its row in ``tensor``.
        errors: position in the list -> why that image could not be used.
    """

    tensor: torch.Tensor
    rows: dict[int, int]
    errors: dict[int, str]


class Classifier:
    """The served classifier: decodes encoded images as ``convnets predict`` does and computes the outputs.

    Args:
        served: what to load and how to run it.
    """

    def __init__(self, served: ServedModel) -> None:
        import torch

        from convnets.deploy.optimize import optimize_for_inference
        from convnets.inference.embed import features_model
        from convnets.preprocessing.classes import class_labels
        from convnets.preprocessing.presets import preset_for_model
        from convnets.registry import choose_model
        from convnets.runtime import resolve_device

        self.served = served
        # The instance's threads: several requests are one batch here, so the cores go to that batch.
        torch.set_num_threads(served.threads)
        self.device = resolve_device(served.device)
        # A checkpoint defines its architecture (served.model is then only its display name).
        model = choose_model(None if served.weights else served.model, path=served.weights,
                             pretrained=served.pretrained, arch_kwargs=served.arch_kwargs, device=self.device,
                             image_size=served.image_size).model
        self.labels = [label.encode("utf-8") for label in class_labels(model)]
        # A multi-label model: sigmoid probabilities, and the labels above their thresholds (served.json's,
        # which also declared the labels output in config.pbtxt).
        self.thresholds = (torch.tensor(served.thresholds, dtype=torch.float64) if served.thresholds is not None
                           else None)
        self.preset = preset_for_model(model).with_crop_size(served.image_size)
        from convnets.preprocessing.device import resolve_decode

        self.decode_path = resolve_decode(served.decode, self.device)
        self.net: Any = None
        self.features: Any = None
        if served.embedding:
            # One pass: the pooled features, then the model's own classifier on them (float32).
            self.features = features_model(model, "layer4", precision=served.precision, device=self.device,
                                           engine=served.engine, cache=served.cache)
            self.head = model.fc.float()
        else:
            self.net = optimize_for_inference(model, served.precision, device=self.device, engine=served.engine,
                                              compile=False, cache=served.cache)

    def decode(self, images: list[bytes]) -> Decoded:
        """Decode and preprocess encoded images; those that cannot be used get an error message."""
        from convnets.preprocessing.pipeline import prepare_batch

        served = self.served
        too_large = {i: f"{len(data)} bytes is more than the server's limit of {served.max_image_bytes} bytes "
                        "per image" for i, data in enumerate(images) if len(data) > served.max_image_bytes}
        readable = [i for i in range(len(images)) if i not in too_large]
        if self.decode_path == "device":
            return self._decode_on_device([bytes(images[i]) for i in readable], readable, too_large)
        # Bytes only, never a path or a URL: what clients send cannot make the server read files or
        # fetch from the network (allow_private=False all the same).
        batch = prepare_batch([bytes(images[i]) for i in readable], on_error="collect", preset=self.preset,
                              max_bytes=served.max_image_bytes, workers=served.threads, allow_private=False,
                              fast_decode=served.fast_decode)
        errors = dict(too_large)
        errors.update({readable[pos]: _BASE64_HINT if _is_base64_image(bytes(images[readable[pos]])) else
                       message_for(error, "cli") for pos, error in batch.errors})
        return Decoded(batch.tensor, {readable[pos]: row for row, pos in enumerate(batch.indices)}, errors)

    def _decode_on_device(self, images: list[bytes], readable: list[int], errors: dict[int, str]) -> Decoded:
        """:meth:`decode` on the device path (:mod:`convnets.preprocessing.device`): headers read on ``threads``
        threads, the JPEGs of the whole batch decoded on the model's device at once, others on the CPU."""
        import torch

        from convnets.errors import ImageLoadError
        from convnets.preprocessing.device import crops_on_device, load_batch_for_device
        from convnets.preprocessing.decode import fast_decode_draft
        from convnets.preprocessing.transforms import normalize_uint8

        draft = fast_decode_draft(self.preset) if self.served.fast_decode else None
        loaded = load_batch_for_device(images, self.preset, workers=self.served.threads, allow_private=False,
                                       draft=draft)
        ok = [pos for pos, x in enumerate(loaded) if isinstance(x, torch.Tensor)]
        crops = dict(zip(ok, crops_on_device([loaded[pos] for pos in ok], [images[pos] for pos in ok],  # type: ignore[misc]
                                             self.preset, self.device, draft=draft)))
        results = {pos: crops.get(pos, loaded[pos]) for pos in range(len(images))}
        errors = dict(errors)
        errors.update({readable[pos]: _BASE64_HINT if _is_base64_image(images[pos]) else message_for(x, "cli")
                       for pos, x in results.items() if isinstance(x, ImageLoadError)})
        good = [pos for pos, x in results.items() if isinstance(x, torch.Tensor)]
        size = self.preset.crop_size
        pixels = (torch.stack([results[pos] for pos in good]) if good  # type: ignore[misc]
                  else torch.empty((0, 3, size, size), dtype=torch.uint8, device=self.device))
        return Decoded(normalize_uint8(pixels, self.preset), {readable[pos]: row for row, pos in enumerate(good)},
                       errors)

    def run(self, batch: torch.Tensor) -> dict[str, npt.NDArray[Any]]:
        """The outputs for a batch of preprocessed images (every row)."""
        import numpy as np
        import torch

        with torch.inference_mode():
            x = batch.to(self.device)
            outputs: dict[str, npt.NDArray[Any]] = {}
            if self.features is not None:
                embedding = self.features(x).float()
                logits = self.head(embedding)
                outputs["embedding"] = embedding.cpu().numpy()
            else:
                logits = self.net(x)
            if self.thresholds is None:
                probabilities = torch.softmax(logits.float(), dim=1).cpu()
            else:
                probabilities = torch.sigmoid(logits.float()).cpu()
                above = probabilities.double() >= self.thresholds  # in float64, as predict compares
                order = torch.argsort(probabilities, dim=1, descending=True, stable=True).tolist()
                outputs["labels"] = np.array([[self.labels[c] for c in row if above[r, c]] + [b""] * (
                    len(row) - int(above[r].sum())) for r, row in enumerate(order)], dtype=object)
            values, indices = probabilities.topk(self.served.topk, dim=1)
        outputs["probabilities"] = probabilities.numpy()
        outputs["top_probabilities"] = values.numpy()
        outputs["top_indices"] = indices.numpy().astype(np.int64)
        outputs["top_labels"] = np.array([[self.labels[i] for i in row] for row in indices.tolist()], dtype=object)
        return outputs


class TritonPythonModel:
    """Triton's Python-backend interface (``initialize``, ``execute``, ``finalize``) around :class:`Classifier`."""

    classifier: Classifier
    refused_family: Any = None
    refused: Any = None  # the REFUSED_METRIC counter of this model

    def initialize(self, args: dict[str, str]) -> None:
        """Load the model of ``served.json`` in the model's directory (``args["model_repository"]``)."""
        model_dir = Path(args["model_repository"])
        try:
            served = ServedModel.from_json((model_dir / SERVED_FILE).read_text(encoding="utf-8"))
            self.classifier = Classifier(served)
        except Exception as e:
            known = isinstance(e, (ConvnetsError, OSError, ValueError))
            reason = message_for(e, "cli") if known else f"{type(e).__name__}: {e}"
            (model_dir / LOAD_ERROR_FILE).write_text(reason, encoding="utf-8")
            raise
        import triton_python_backend_utils as pb_utils

        self.refused_family = pb_utils.MetricFamily(name=REFUSED_METRIC, description="Requests the model refused "
                                                    "(a bad image, no input)", kind=pb_utils.MetricFamily.COUNTER)
        self.refused = self.refused_family.Metric(labels={"model": args["model_name"],
                                                          "version": args["model_version"]})

    def execute(self, requests: list[Any]) -> list[Any]:
        """Answer the requests of one batch: outputs for each, or an error for those with a bad image."""
        import triton_python_backend_utils as pb_utils

        images: list[bytes] = []
        spans: list[range | str] = []  # per request: its images' positions in `images`, or its error
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, INPUT)
            items = [] if tensor is None else list(tensor.as_numpy().reshape(-1))
            if not items:
                spans.append(f"the request has no {INPUT!r} input, or it is empty")
                continue
            spans.append(range(len(images), len(images) + len(items)))
            images.extend(items)
        decoded = self.classifier.decode(images)
        for i, span in enumerate(spans):  # a request with a bad image gets one error, the first image's
            if isinstance(span, range) and (bad := next((p for p in span if p in decoded.errors), None)) is not None:
                where = f"image {bad - span.start}" + (f" of {len(span)}" if len(span) > 1 else "")
                spans[i] = f"{where}: {decoded.errors[bad]}"
        answered = [p for span in spans if isinstance(span, range) for p in span]
        outputs = self.classifier.run(decoded.tensor[[decoded.rows[p] for p in answered]]) if answered else {}
        row_of = {p: row for row, p in enumerate(answered)}
        responses = []
        for span in spans:
            if isinstance(span, str):
                log.info("request refused: %s", span)
                self.refused.increment(1)
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(span, pb_utils.TritonError.INVALID_ARG)))
                continue
            rows = [row_of[p] for p in span]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, value[rows]) for name, value in outputs.items()]))
        return responses

    def finalize(self) -> None:
        """Release the counter before its family, as the Python backend asks."""
        self.refused = self.refused_family = None
