"""Pretrained weights: the manifest, download and cache, checkpoint layouts and loading."""

from convnets.weights.download import MIRROR_ENV, cache_dir, fetch_weights
from convnets.weights.layouts import infer_spec, split_checkpoint, to_canonical
from convnets.weights.files import read_checkpoint
from convnets.weights.load import build_model, read_state_dict
from convnets.weights.manifest import WeightsEntry, load_manifest

__all__ = ["MIRROR_ENV", "WeightsEntry", "build_model", "cache_dir", "fetch_weights", "infer_spec",
           "load_manifest", "read_checkpoint", "read_state_dict", "split_checkpoint", "to_canonical"]
