"""Fine-tuning of the ResNet family with NVIDIA's recipe: ``convnets train`` / ``python -m convnets.train``.

From Python::

    from convnets.train import TrainConfig, fit
    summary = fit(TrainConfig(data="data/", output="runs/1", arch="se_resnext101_32x4d",
                              pretrained=True, epochs=10, batch_size=64))
    print(summary.line())

``convnets.load_model("runs/1/model_best.pth.tar")`` rebuilds the fine-tuned model, class names
included; measuring a model on a labelled image set is :mod:`convnets.evaluation` (``convnets evaluate``).
:func:`benchmark_training` times the loop's optimizer step on synthetic data;
:func:`write_curves` draws a run's ``curves.png`` from its ``metrics.jsonl`` (``convnets plot``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.lazy import lazy_getattr
from convnets.train.config import TrainConfig

if TYPE_CHECKING:
    from convnets.train.benchmark import benchmark_training
    from convnets.train.curves import write_curves
    from convnets.train.loop import evaluate, fit
    from convnets.train.metrics import TrainSummary
    from convnets.train.step import Trainer

__all__ = ["TrainConfig", "TrainSummary", "Trainer", "benchmark_training", "evaluate", "fit", "write_curves"]

# The loop pulls in torchvision, DDP and tqdm: each name's module is imported on first use, so that
# building the `convnets` command line (which reads TrainConfig's defaults) stays fast.
__getattr__ = lazy_getattr(__name__, {"Trainer": "step", "fit": "loop", "evaluate": "loop", "TrainSummary": "metrics",
                                      "benchmark_training": "benchmark", "write_curves": "curves"})
