"""Deployment: a fast inference path, verified ONNX / TorchScript export with Triton model
repositories, and throughput benchmarks.

* :func:`optimize_for_inference` (:mod:`convnets.deploy.optimize`)
* :func:`~convnets.deploy.export.export_model` and :mod:`convnets.deploy.triton`
  (``convnets export``; needs the ``export`` extra for ONNX)
* :mod:`convnets.deploy.benchmark` (``convnets benchmark``)
"""

from convnets.deploy.optimize import OptimizedModel, fold_batchnorm, optimize_for_inference

__all__ = ["OptimizedModel", "fold_batchnorm", "optimize_for_inference"]
