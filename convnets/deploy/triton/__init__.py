"""Triton Inference Server: the model repositories that convnets writes, in one place.

* :mod:`~convnets.deploy.triton.config`: the one writer of ``config.pbtxt`` (Triton's ``ModelConfig``
  protobuf), model names and ``labels.txt``, for both repositories below;
* :mod:`~convnets.deploy.triton.repository`: ``convnets export --triton``'s repository around an exported
  file (the format's own Triton backend, or Triton's Python backend running it);
* :mod:`~convnets.deploy.triton.python_backend`: that Python variant's ``model.py``, copied, never imported.

``convnets serve`` writes its own repository (:mod:`convnets.serve.repository`, a classifier on the Python
backend) with the same config writer.
"""

from __future__ import annotations

from convnets.deploy.triton.config import check_model_name, config_text, write_labels
from convnets.deploy.triton.repository import (TRITON_BACKENDS, check_triton_format, model_version_dir, triton_config,
                                               triton_files, triton_python_source, write_triton_files)

__all__ = ["TRITON_BACKENDS", "check_model_name", "check_triton_format", "config_text", "model_version_dir",
           "triton_config", "triton_files", "triton_python_source", "write_labels", "write_triton_files"]
