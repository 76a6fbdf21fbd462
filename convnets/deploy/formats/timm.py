"""timm's format: a folder with ``config.json`` and ``model.safetensors``, as the Hugging Face Hub holds timm models.

timm (``timm.create_model("local-dir:DIR", pretrained=True)``, or ``hf-hub:`` once the folder is
pushed), segmentation_models_pytorch's ``tu-`` encoders and ``transformers``' timm wrapper load it.
Our ResNet-50 and ResNeXt101-32x4d are timm's ``resnet50`` and ``resnext101_32x4d``: the same
modules under the same names, so the state dict is written as it is (BatchNorm not folded) and
``config.json`` names the architecture, the head (``num_classes``, ``label_names``) and the
preprocessing (``pretrained_cfg``: mean, std, crop_pct, interpolation, input_size).

SE-ResNeXt101-32x4d has no timm counterpart: NVIDIA's SE block squeezes every stage to a fixed 16
channels with linear layers, timm's ``seresnext101_32x4d`` to channels/16 with 1x1 convolutions,
so its weights cannot be expressed in any timm architecture.

References: https://huggingface.co/docs/timm/quickstart ,
https://github.com/huggingface/pytorch-image-models/blob/main/timm/models/_hub.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.deploy.formats.base import ExportFormat, Runner
from convnets.errors import ExportError
from convnets.models.specs import ArchSpec, registered_name

if TYPE_CHECKING:
    from torch import Tensor, nn

#: Our registered models that are timm architectures: weights, key names and forward are the same.
TIMM_ARCHITECTURES: dict[str, str] = {"resnet50": "resnet50", "resnext101_32x4d": "resnext101_32x4d"}

CONFIG = "config.json"


def timm_architecture(spec: ArchSpec | None) -> str:
    """The timm architecture that is the network of ``spec``.

    Raises:
        ExportError: there is none (SE-ResNeXt, a changed architecture, not a convnets ResNet); the
            message says why.
    """
    name = registered_name(spec) if spec is not None else None
    if name in TIMM_ARCHITECTURES:
        return TIMM_ARCHITECTURES[name]
    if spec is not None and spec.se_squeeze is not None:
        raise ExportError(
            f"{name or 'this SE-ResNeXt'} cannot be written in timm's format: no timm architecture has its SE block. "
            f"NVIDIA's squeezes every stage to a fixed {spec.se_squeeze} channels with Linear layers; timm's "
            "seresnext101_32x4d squeezes to channels/16 with 1x1 convolutions, so the weights do not fit it. "
            "Use another format (onnx, openvino, aoti) or convnets' own checkpoints")
    published = ", ".join(f"{ours} (timm {TIMM_ARCHITECTURES[ours]})" for ours in TIMM_ARCHITECTURES)
    what = f"this architecture ({spec})" if spec is not None else "a module that is not a convnets ResNet"
    raise ExportError(f"timm's format holds the published {published} only, not {what}; fine-tuned heads "
                      "(num_classes, class names) are fine")


def timm_config(module: nn.Module, image_size: int) -> dict[str, Any]:
    """timm's ``config.json`` for ``module`` (a convnets ResNet) evaluated at crops of ``image_size``.

    The preprocessing is this package's evaluation preset for that size (NVIDIA's: resize to 256/224
    of the crop, bilinear, ImageNet mean and std); ImageNet heads get timm's ImageNet labels (WordNet
    synsets in ``label_names``, the names in ``label_descriptions``).
    """
    from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes, get_imgnet_synsets
    from convnets.preprocessing.presets import EvalPreset

    preset = EvalPreset.for_image_size(image_size)
    num_classes = int(getattr(module, "num_classes"))
    config: dict[str, Any] = {"architecture": timm_architecture(getattr(module, "spec", None)),
                              "num_classes": num_classes, "num_features": int(getattr(module, "num_features")),
                              "global_pool": "avg"}
    class_names = getattr(module, "class_names", None)
    if class_names is not None:
        config["label_names"] = list(class_names)
    elif num_classes == NUM_CLASSES:
        synsets = [str(s) for s in get_imgnet_synsets()]
        config["label_names"] = synsets
        config["label_descriptions"] = dict(zip(synsets, (str(n) for n in get_imgnet_classes())))
    config["pretrained_cfg"] = {
        "custom_load": False,
        "input_size": [3, image_size, image_size],
        "fixed_input_size": False,
        "interpolation": preset.interpolation,
        "crop_pct": round(preset.crop_size / preset.resize_size, 4),
        "crop_mode": "center",
        "mean": list(preset.mean),
        "std": list(preset.std),
        "num_classes": num_classes,
        "pool_size": [-(-image_size // 32)] * 2,
        "first_conv": "conv1",
        "classifier": "fc",
    }
    return config


class TimmFormat(ExportFormat):
    """A timm model folder: ``model.safetensors`` (the state dict as it is) and ``config.json``."""

    name = "timm"
    description = "a folder for timm, the Hugging Face Hub, segmentation_models_pytorch; resnet50, resnext101_32x4d"
    file_names = ("model.safetensors", CONFIG)
    runtime = "timm.create_model('local-dir:...')"
    extra = "timm"
    requires = ("timm",)
    precisions = ("fp32",)
    folds_batchnorm = False  # timm's modules have their BatchNorm layers

    def check_architecture(self, spec: ArchSpec | None) -> None:
        timm_architecture(spec)

    def files(self, path: Path) -> tuple[Path, ...]:
        # timm looks for these exact names in the folder.
        return tuple(path.parent / name for name in self.file_names)

    def write(self, module: nn.Module, path: Path, example: Tensor) -> None:
        from convnets.fileio import atomic_write
        from convnets.weights.safetensors_io import save_safetensors

        image_size = int(example.shape[-1])
        config = timm_config(module, image_size)
        # The file also records the architecture for convnets.load_model (safetensors metadata,
        # which timm ignores).
        save_safetensors(module, path, image_size=image_size)
        atomic_write(path.parent / CONFIG, lambda f: f.write(json.dumps(config, indent=2).encode()))

    def load_runner(self, path: Path) -> Runner:
        import torch
        import timm

        # local-dir: timm reads config.json (architecture, head) and model.safetensors itself.
        model = timm.create_model(f"local-dir:{path.parent}", pretrained=True).eval()

        def run(batch: Tensor) -> Tensor:
            with torch.no_grad():
                return model(batch).float()
        return run


FORMAT = TimmFormat()
