"""Values the command line needs before PyTorch is imported, each defined once.

``--help`` and usage errors must answer without importing PyTorch, PIL or requests, so the modules
that use these values import them from here rather than the other way round. Nothing here imports
anything.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "CACHE_DIR_ENV", "CACHE_MAX_SIZE_ENV", "DECODES", "DEFAULT_CACHE_MAX_SIZE", "DEFAULT_EXPLAIN_METHOD",
           "DEFAULT_EXPLAIN_OUTPUT",
           "DEFAULT_IMAGE_SIZE", "DEFAULT_MODEL", "DEFAULT_TIMEOUT", "DEFAULT_TOPK", "EXPLAIN_METHODS", "IMAGE_SUFFIXES",
           "LAYERS", "MAX_BATCH_SIZE",
           "MAX_IMAGE_SIZE", "MAX_REDIRECTS", "MAX_THREADS", "MIRROR_ENV", "PRIVATE_URLS_OPTION", "TRITON_BACKENDS",
           "VERSION"]

#: This package's version (``convnets.__version__``, ``convnets --version``; setup.py states it too).
VERSION = "0.1.0"

#: The architecture that ``predict`` and ``embed`` use without ``--model`` or ``--weights``.
DEFAULT_MODEL = "se_resnext101_32x4d"

#: The input size of NVIDIA's ImageNet weights, and of models without a recorded one (``--image-size``).
DEFAULT_IMAGE_SIZE = 224

#: The largest image size (center crop, in pixels) accepted from ``--image-size``, ``image_size=`` or a
#: checkpoint's record. 18 times the ImageNet 224 and 5 times the largest evaluation crop in common use
#: (800 px, EfficientNet-L2); above it the input alone, resized to ``size * 256 / 224``, passes 250 MB per
#: image and the stem's activations a gigabyte, so a larger value is a typo or a hostile file, refused
#: before anything is allocated.
MAX_IMAGE_SIZE = 4096

#: The largest batch size accepted from ``--batch-sizes``: 16 times the largest of NVIDIA's
#: throughput tables (256); a batch of 4096 images of 224 px is already 2.4 GB of float32 input.
MAX_BATCH_SIZE = 4096

#: The most threads ``--threads`` / ``EngineSettings(threads=)`` asks a runtime for: ONNX Runtime
#: and PyTorch start as many as they are told (OpenVINO caps them at the cores), so a typo such as
#: 100000 would exhaust the process's threads; no CPU this package runs on has more cores.
MAX_THREADS = 1024

#: Seconds allowed for each image download (connecting included) unless ``timeout=`` / ``--timeout``.
DEFAULT_TIMEOUT = 30.0

#: Where JPEGs are decoded (``--decode``, ``decode=``): ``auto`` (on the model's device when it is a CUDA GPU,
#: else on the CPU), ``cpu`` (Pillow, the exact upstream path), ``device`` (``torchvision.io.decode_jpeg`` and
#: tensor preprocessing on the model's device, on the CPU too; see convnets/preprocessing/device.py).
DECODES = ("auto", "cpu", "device")

#: Classes per image that ``convnets predict`` shows unless ``--topk`` (fewer if the model has fewer).
DEFAULT_TOPK = 5

#: ``convnets explain --method`` / ``convnets.explain(method=)``: name -> pytorch-grad-cam's class. Methods
#: that run one forward and one backward pass per batch (ScoreCAM and AblationCAM run hundreds of forwards).
EXPLAIN_METHODS: dict[str, str] = {
    "gradcam": "GradCAM",
    "gradcam++": "GradCAMPlusPlus",
    "hirescam": "HiResCAM",
    "xgradcam": "XGradCAM",
    "layercam": "LayerCAM",
    "eigengradcam": "EigenGradCAM",
}

#: The method of ``convnets explain`` without ``--method``. HiResCAM is Grad-CAM without the averaging of
#: each channel's gradient over the map: at the last stage of these networks (global average pooling, then
#: the classifier) the gradient is the same at every position, so the two give the same map there; at an
#: earlier stage, which small inputs are explained from, HiResCAM's follows the model where Grad-CAM's
#: average blurs it (measured on generated patterns: docs/explain.md).
DEFAULT_EXPLAIN_METHOD = "hirescam"
#: Where ``convnets explain`` writes without ``--output``: a folder of the current directory.
DEFAULT_EXPLAIN_OUTPUT = "explanations"

#: Redirects followed at most by a download (images and weights); one more is an error.
MAX_REDIRECTS = 5

#: The option of the commands that read URLs (predict, embed, export --images) that lets them fetch
#: from loopback, private and link-local addresses (``allow_private=True`` in Python).
PRIVATE_URLS_OPTION = "--deny-private-urls"

#: File endings that a directory input is searched for (case-insensitive).
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"})

#: The stages whose pooled output can be an embedding (ResNet-family models have four).
LAYERS: tuple[str, ...] = ("layer1", "layer2", "layer3", "layer4")

#: Environment variable naming a directory or URL that replaces the NGC host for pretrained weights.
MIRROR_ENV = "CONVNETS_WEIGHTS_MIRROR"

#: Environment variable naming the engine cache's directory (:mod:`convnets.deploy.cache`; default:
#: ``convnets-engines`` under ``torch.hub.get_dir()``, beside the weights).
CACHE_DIR_ENV = "CONVNETS_CACHE_DIR"

#: Environment variable setting the engine cache's size limit (``4GiB``, ``500M``, bytes); past it the
#: least recently used entries are removed.
CACHE_MAX_SIZE_ENV = "CONVNETS_CACHE_MAX_SIZE"

#: The engine cache's default size limit: 4 GiB. An entry is one converted graph, about the size of
#: the weights in fp32 (SE-ResNeXt101: 173 MiB); 4 GiB holds some 24 such, e.g. the three models on
#: both engines in fp32 and bf16 at two image sizes, so a user's usual runs never convert twice,
#: while a machine that tries many weights or sizes stops growing at a size that matters on no disk.
DEFAULT_CACHE_MAX_SIZE = 4 << 30

#: ``convnets train --data-backend`` choices (see :mod:`convnets.data`).
BACKENDS: tuple[str, ...] = ("pytorch", "dali-cpu", "dali-gpu", "synthetic")

#: ``convnets export --triton-backend`` choices: the format's own Triton backend, or Triton's Python
#: backend running the file (see :mod:`convnets.deploy.triton`).
TRITON_BACKENDS: tuple[str, ...] = ("native", "python")

#: The files of an evaluation report (``convnets evaluate --output DIR``; :mod:`convnets.evaluation.report`).
REPORT_FILES: tuple[str, str] = ("report.json", "confusion.png")
