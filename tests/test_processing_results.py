"""pick_n_best and the bundled ImageNet class names, checked against independent computations."""

from __future__ import annotations

import os
import socket
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from processing_utils import get_imgnet_classes, get_imgnet_synsets, get_utils, pick_n_best
from convnets.preprocessing import classes as classes_module



def _bundled_rows() -> list[list[str]]:
    """The bundled TSV parsed with plain string operations (header dropped)."""
    text = (resources.files("convnets.preprocessing") / "imagenet_classes.tsv").read_text("utf-8")
    lines = text.splitlines()
    assert lines[0] == "index\tsynset\tnames"
    return [line.split("\t") for line in lines[1:]]


def _names() -> list[str]:
    return [row[2] for row in _bundled_rows()]


def _softmax(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, 1000, generator=generator) * 3, dim=1)


def _expected_top(scores: np.ndarray, n: int) -> list[list[tuple[str, str]]]:
    """Upstream's formatting with an explicit (score desc, index asc) order, in plain Python."""
    names = _names()
    result = []
    for row in scores.astype(np.float32):
        order = sorted(range(len(row)), key=lambda c: (-float(row[c]), c))[:n]
        result.append([(names[c], f"{100 * row[c]:.1f}%") for c in order])
    return result


# ---- pick_n_best --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 5, 17])
def test_matches_independent_top_n(n: int) -> None:
    probs = _softmax(4, seed=n)
    assert pick_n_best(probs, n=n, verbose=False) == _expected_top(probs.numpy(), n)


def test_prints_like_upstream(capsys: pytest.CaptureFixture[str]) -> None:
    probs = _softmax(3, seed=0)
    result = pick_n_best(probs)
    expected = _expected_top(probs.numpy(), 5)
    assert result == expected
    printed = capsys.readouterr().out
    assert printed == "".join(f"sample {i}: {expected[i]!r}\n" for i in range(3))
    assert printed.startswith("sample 0: [('")


def test_verbose_false_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    pick_n_best(_softmax(2, seed=1), verbose=False)
    assert capsys.readouterr().out == ""


def test_known_class_and_percentage() -> None:
    probs = torch.zeros(1000)
    probs[285], probs[281], probs[0] = 0.873, 0.1, 0.027
    assert pick_n_best(probs, n=3, verbose=False) == [[
        ("Egyptian cat", "87.3%"), ("tabby, tabby cat", "10.0%"), ("tench, Tinca tinca", "2.7%")]]


def test_one_dimensional_input_is_one_sample() -> None:
    probs = _softmax(1, seed=2)
    assert pick_n_best(probs[0], verbose=False) == _expected_top(probs.numpy(), 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype(dtype: torch.dtype) -> None:
    probs = _softmax(2, seed=3).to(dtype)
    expected = _expected_top(probs.float().numpy(), 4)
    assert pick_n_best(probs, n=4, verbose=False) == expected


def test_numpy_input_and_grad_tensor() -> None:
    probs = _softmax(2, seed=4)
    expected = _expected_top(probs.numpy(), 5)
    assert pick_n_best(probs.numpy(), verbose=False) == expected
    assert pick_n_best(probs.clone().requires_grad_(), verbose=False) == expected


def test_ties_break_by_lower_class_index() -> None:
    probs = torch.zeros(2, 1000)
    probs[0, [900, 7, 500, 3]] = 0.25
    probs[1, :] = 0.001
    names = _names()
    top = pick_n_best(probs, n=4, verbose=False)
    assert [name for name, _ in top[0]] == [names[3], names[7], names[500], names[900]]
    assert [name for name, _ in top[1]] == names[:4]


@pytest.mark.parametrize("n", [0, -1, 1001, 2.0, True, "5"])
def test_invalid_n(n: object) -> None:
    with pytest.raises(ValueError, match="n must be"):
        pick_n_best(_softmax(1, seed=5), n=n, verbose=False)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(2, 999), (1001,), (2, 3, 1000), ()])
def test_invalid_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"shape \[N, 1000\]"):
        pick_n_best(torch.rand(shape), verbose=False)


def test_invalid_type() -> None:
    with pytest.raises(TypeError, match="list"):
        pick_n_best([[0.5] * 1000], verbose=False)  # type: ignore[arg-type]


# ---- class names ----------------------------------------------------------------------------------

def test_class_names_are_the_bundled_table() -> None:
    classes = get_imgnet_classes()
    assert isinstance(classes, np.ndarray) and classes.shape == (1000,)
    assert classes[0] == "tench, Tinca tinca"
    assert classes[285] == "Egyptian cat"
    assert classes[999] == "toilet tissue, toilet paper, bathroom tissue"
    rows = _bundled_rows()
    assert [row[0] for row in rows] == [str(i) for i in range(1000)]
    assert classes.tolist() == [row[2] for row in rows]
    assert get_imgnet_synsets().tolist() == [row[1] for row in rows]
    assert get_imgnet_synsets()[0] == "n01440764"
    assert get_utils().get_imgnet_classes().tolist() == classes.tolist()


def test_callers_cannot_corrupt_the_cache() -> None:
    classes = get_imgnet_classes()
    classes[0] = "corrupted"
    assert get_imgnet_classes()[0] == "tench, Tinca tinca"
    probs = torch.zeros(1000)
    probs[0] = 1.0
    assert pick_n_best(probs, n=1, verbose=False) == [[("tench, Tinca tinca", "100.0%")]]


def test_offline_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("get_imgnet_classes tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.chdir(tmp_path)
    classes_module._table.cache_clear()  # make this call really read the table
    try:
        assert len(get_imgnet_classes()) == 1000
        pick_n_best(_softmax(1, seed=6), verbose=False)
    finally:
        classes_module._table.cache_clear()
    assert os.listdir(tmp_path) == []


def test_class_order_agrees_with_torchvision() -> None:
    """An independent source that CI always has: torchvision's ImageNet category names.

    torchvision uses one synonym per class, disambiguating two ('crane bird', 'maillot tank suit').
    """
    import torchvision

    categories = torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["categories"]
    disambiguated = {134: "crane", 639: "maillot, tank suit"}
    for index, (category, names) in enumerate(zip(categories, get_imgnet_classes(), strict=True)):
        synonyms = [s.strip().lower() for s in names.split(",")]
        assert category.lower() in synonyms or names == disambiguated.get(index), (index, category, names)
