"""The Models page's cards state what the code computes, checked against torchvision's own published
figures for the architecture both libraries share (ResNet-50 v1.5)."""

from __future__ import annotations

import re

import pytest
from conftest import REPO
from test_docs_charts import _load
from torchvision.models import ResNet50_Weights

from convnets.models.specs import MODELS
from convnets.weights.manifest import load_manifest

cards = _load("cards")


def test_resnet50s_gflops_and_weights_are_torchvisions() -> None:
    """torchvision's ResNet-50 (the v1.5 layout) publishes 4.089 GFLOPS and a 97.8 MB file; the card's
    numbers come from counting our model on the meta device."""
    meta = ResNet50_Weights.IMAGENET1K_V1.meta
    params, gflops, weights = cards.complexity("resnet50")
    assert params == meta["num_params"]
    assert gflops == pytest.approx(meta["_ops"], abs=0.001)
    assert weights / 2**20 == pytest.approx(meta["_file_size"], rel=0.01)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_card_shows_the_computed_numbers(name: str) -> None:
    params, gflops, weights = cards.complexity(name)
    text = cards.card(name, REPO, REPO / "benchmarks" / "results", [], lambda head, rows: repr(rows))
    assert f"{params:,}" in text and f"{gflops:.2f}" in text and f"{weights / 2**20:.1f} MiB" in text
    assert params == load_manifest()[name].num_params
    assert re.search(r"CenterCrop\(224\)", text)
