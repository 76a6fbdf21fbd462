"""processing_utils.classify: upstream's prepare -> softmax(model) -> pick_n_best, through an engine (issue 9).

The reference is the upstream idiom written out with the facade's own helpers on the package's
example photos; the engine path is checked to actually build and call the engine asked for.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, randomize_bn
from strict_skips import require_module

import convnets
import processing_utils
from convnets.assets import example_images
from convnets.deploy.engines import get_engine
from convnets.errors import InvalidArgumentError

SIZE = {"image_size": 64, "resize_size": 73}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = randomize_bn(convnets.get_model("resnext101_32x4d", **TINY["resnext101_32x4d"])).eval()
    net.input_size = 64  # the engine builds its graph at this size
    return net


def upstream(model: torch.nn.Module, n: int) -> list[list[tuple[str, str]]]:
    batch = processing_utils.prepare_input_from_uri(example_images(), **SIZE)
    with torch.no_grad():
        return processing_utils.pick_n_best(torch.softmax(model(batch), dim=1), n=n, verbose=False)


def names(tops: list[list[tuple[str, str]]]) -> list[list[str]]:
    return [[name for name, _ in row] for row in tops]


def test_classify_without_an_engine_is_the_upstream_idiom(model: torch.nn.Module,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    got = processing_utils.get_utils().classify(model, example_images(), n=3, **SIZE)
    assert got == upstream(model, 3) and len(got) == len(example_images())
    assert capsys.readouterr().out.startswith("sample 0: [")  # prints as upstream's pick_n_best


def test_classify_runs_the_engine_named_by_the_keyword(model: torch.nn.Module,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("onnxruntime")
    engine = get_engine("onnxruntime")
    built, calls = [], []
    build = engine.build

    def spy(*args: object, **kwargs: object) -> torch.nn.Module:
        module = build(*args, **kwargs)
        forward = module.forward
        module.forward = lambda x: calls.append(len(x)) or forward(x)
        built.append(module)
        return module
    monkeypatch.setattr(engine, "build", spy)
    got = processing_utils.classify(model, example_images(), n=3, engine="onnxruntime", verbose=False, **SIZE)
    assert len(built) == 1 and calls == [len(example_images())]
    expected = upstream(model, 3)
    assert names(got) == names(expected)
    for row, ref in zip(got, expected):  # fp32 engine: the same percentages, up to the last digit
        assert all(abs(float(a[1][:-1]) - float(b[1][:-1])) <= 0.11 for a, b in zip(row, ref))


def test_precision_without_an_engine_is_refused(model: torch.nn.Module) -> None:
    with pytest.raises(InvalidArgumentError, match="engine="):
        processing_utils.classify(model, example_images(), precision="bf16", **SIZE)


def test_the_facade_forwards_optimize_for_inference(model: torch.nn.Module) -> None:
    fast = processing_utils.get_utils().optimize_for_inference(model, "fp32", engine="torch", compile=False)
    assert fast.engine == "torch"
    x = processing_utils.prepare_input_from_uri(example_images(), **SIZE)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-4)
