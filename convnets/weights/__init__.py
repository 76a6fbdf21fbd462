"""Pretrained weights: the manifest, download and cache, checkpoint layouts and loading.

PyTorch is imported on first use of a name that needs it: the command line reads the manifest
(:mod:`convnets.weights.manifest`) while it checks its arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.lazy import lazy_getattr

if TYPE_CHECKING:
    from convnets.weights.download import MIRROR_ENV, cache_dir, fetch_weights
    from convnets.weights.files import read_checkpoint
    from convnets.weights.layouts import infer_spec, split_checkpoint, to_canonical
    from convnets.weights.load import build_model, read_state_dict
    from convnets.weights.manifest import WeightsEntry, load_manifest

__all__ = ["MIRROR_ENV", "WeightsEntry", "build_model", "cache_dir", "fetch_weights", "infer_spec",
           "load_manifest", "read_checkpoint", "read_state_dict", "split_checkpoint", "to_canonical"]

__getattr__ = lazy_getattr(__name__, {
    "MIRROR_ENV": "download", "cache_dir": "download", "fetch_weights": "download",
    "infer_spec": "layouts", "split_checkpoint": "layouts", "to_canonical": "layouts",
    "read_checkpoint": "files", "build_model": "load", "read_state_dict": "load",
    "WeightsEntry": "manifest", "load_manifest": "manifest"})
