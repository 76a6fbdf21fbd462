"""optimize_for_inference and fold_batchnorm: faithful outputs, exact folding, fallbacks, errors.

Speed is measured by benchmarks/bench_inference.py, not here. Models are tiny (random weights with
random BatchNorm statistics, so that folding changes real numbers); only two tests compile, on a
one-block network, because inductor compiles take tens of seconds on a small CPU.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convnets
from convnets.deploy.optimize import OptimizedModel, compile_unavailable_reason, fold_batchnorm
from convnets.errors import UnsupportedPrecisionError
from convnets.models.resnet import Bottleneck

TINY_SE = dict(layers=[1, 1, 1, 1], widths=[16, 32, 64, 128], cardinality=4, se_squeeze=8, stem_width=16)
ONE_BLOCK = dict(layers=[1], widths=[16], cardinality=4, se_squeeze=8, stem_width=16)

BF16_CPU = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def tiny_model(seed: int = 0, **arch: object) -> convnets.ResNet:
    """A small SE-ResNeXt in eval mode with random, non-trivial BatchNorm parameters and statistics."""
    torch.manual_seed(seed)
    model = convnets.get_model("se_resnext101_32x4d", num_classes=10, **(arch or TINY_SE))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.3, 3.0)
            m.weight.data.uniform_(0.3, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def images(n: int = 3, size: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def max_rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def conv_bn_pairs(model: convnets.ResNet) -> list[tuple[str, nn.Conv2d, nn.BatchNorm2d]]:
    """Every (convolution, BatchNorm) pair of the network, found by walking it here."""
    pairs = [("conv1", model.conv1, model.bn1)]
    for name, m in model.named_modules():
        if isinstance(m, Bottleneck):
            pairs += [(f"{name}.conv{i}", getattr(m, f"conv{i}"), getattr(m, f"bn{i}")) for i in (1, 2, 3)]
            if m.downsample is not None:
                pairs.append((f"{name}.downsample.0", m.downsample[0], m.downsample[1]))
    return pairs


# --- BatchNorm folding ---------------------------------------------------------------------------

def test_folding_leaves_no_batchnorm_and_each_conv_equals_conv_then_batchnorm() -> None:
    model = tiny_model()
    folded = fold_batchnorm(copy.deepcopy(model))

    assert not [n for n, m in folded.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    modules = dict(folded.named_modules())
    pairs = conv_bn_pairs(model)
    assert len(pairs) == 1 + 4 * 3 + 4  # stem + 3 per block + 4 downsample branches
    for name, conv, bn in pairs:
        x = torch.randn(2, conv.in_channels, 9, 9)
        expected = F.batch_norm(
            F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups),
            bn.running_mean, bn.running_var, bn.weight, bn.bias, training=False, eps=bn.eps)
        with torch.no_grad():
            got = modules[name](x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_folded_network_matches_original() -> None:
    model, x = tiny_model(), images()
    folded = fold_batchnorm(copy.deepcopy(model))
    assert max_rel_error(reference(folded, x), reference(model, x)) < 1e-5


def test_folding_refuses_a_model_in_training_mode() -> None:
    with pytest.raises(ValueError, match="eval"):
        fold_batchnorm(tiny_model().train())


# --- optimize_for_inference: outputs -------------------------------------------------------------

def test_fp32_eager_matches_the_unoptimized_model() -> None:
    model, x = tiny_model(), images()
    optimized = convnets.optimize_for_inference(model, "fp32", compile=False)
    out = optimized(x)
    assert isinstance(optimized, OptimizedModel) and not optimized.compiled
    assert out.dtype == torch.float32 and out.shape == (3, 10)
    assert max_rel_error(out, reference(model, x)) < 1e-4
    assert not any(isinstance(m, nn.BatchNorm2d) for m in optimized.modules())


@pytest.mark.skipif(not BF16_CPU, reason="this CPU has no native bf16 support")
def test_bf16_eager_logits_have_cosine_099_per_sample() -> None:
    model, x = tiny_model(), images(4)
    out = convnets.optimize_for_inference(model, "bf16", compile=False)(x)
    assert out.dtype == torch.float32
    cosine = F.cosine_similarity(out.double(), reference(model, x).double(), dim=1)
    assert cosine.shape == (4,) and bool((cosine >= 0.99).all()), cosine


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.skipif(
    not BF16_CPU, reason="this CPU has no native bf16 support"))])
def test_compiled_model_matches_the_unoptimized_model(precision: str) -> None:
    model, x = tiny_model(**ONE_BLOCK), images(2, size=32)
    if compile_unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip("torch.compile cannot work on this machine")
    optimized = convnets.optimize_for_inference(model, precision)
    out = optimized(x)
    assert optimized.compiled, "compilation fell back to eager"
    expected = reference(model, x)
    if precision == "fp32":
        assert max_rel_error(out, expected) < 1e-4
    else:
        assert bool((F.cosine_similarity(out.double(), expected.double(), dim=1) >= 0.99).all())
    if torch.backends.mkldnn.is_available():
        # Frozen graphs run oneDNN convolutions on prepacked weights with fused post-ops; an
        # unfrozen graph calls aten::mkldnn_convolution instead (and is markedly slower).
        with torch.profiler.profile() as prof:
            optimized(x)
        ops = {event.name for event in prof.events()}
        assert "mkldnn::_convolution_pointwise" in ops and "aten::mkldnn_convolution" not in ops, sorted(ops)


def test_input_is_moved_to_the_model_layout_and_any_batch_size_works() -> None:
    model = tiny_model()
    optimized = convnets.optimize_for_inference(model, compile=False)
    for x in (images(1), images(5).contiguous(memory_format=torch.channels_last), images(2).double()):
        assert max_rel_error(optimized(x), reference(model, x.float())) < 1e-4


def test_the_callers_model_is_not_modified() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules_before = [type(m) for m in model.modules()]
    convnets.optimize_for_inference(model, "bf16" if BF16_CPU else "fp32", compile=False)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
    assert [type(m) for m in model.modules()] == modules_before
    assert not model.training
    assert model.conv1.weight.is_contiguous()  # not switched to channels_last


def test_class_metadata_is_carried_over() -> None:
    model = tiny_model()
    model.class_names = [f"class {i}" for i in range(10)]
    optimized = convnets.optimize_for_inference(model, compile=False)
    assert optimized.class_names == model.class_names and optimized.num_classes == 10


# --- errors --------------------------------------------------------------------------------------

def test_fp16_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(UnsupportedPrecisionError, match="CUDA") as info:
        convnets.optimize_for_inference(tiny_model(), "fp16", device="cpu")
    assert "bf16" in str(info.value)  # says what to use instead
    assert isinstance(info.value, ValueError)


def test_unknown_precision_and_training_mode_and_int8_calibration_are_rejected() -> None:
    with pytest.raises(ValueError, match="precision"):
        convnets.optimize_for_inference(tiny_model(), "int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eval"):
        convnets.optimize_for_inference(tiny_model().train())
    with pytest.raises(ValueError, match="int8"):
        convnets.optimize_for_inference(tiny_model(), calibration_data=images())


# --- compile fallback ----------------------------------------------------------------------------

def test_compilation_failing_at_the_first_call_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def lazy_failing_compile(module: nn.Module, **kwargs: object) -> object:
        def run(x: torch.Tensor) -> torch.Tensor:  # torch.compile compiles at the first call
            calls.append(x.shape)
            raise RuntimeError("simulated: C++ compile error")
        return run
    monkeypatch.setattr(torch, "compile", lazy_failing_compile)
    model, x = tiny_model(), images()
    optimized = convnets.optimize_for_inference(model)
    assert optimized.compiled
    with caplog.at_level(logging.WARNING, logger="convnets.deploy.optimize"):
        out = optimized(x)
    assert len(calls) == 1 and not optimized.compiled
    assert any("falling back to eager" in r.getMessage() for r in caplog.records)
    assert max_rel_error(out, reference(model, x)) < 1e-4
    optimized(x)
    assert len(calls) == 1  # not retried


def test_an_input_error_is_raised_not_mistaken_for_a_compile_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def compile_passthrough(module: nn.Module, **kwargs: object) -> nn.Module:
        return module
    monkeypatch.setattr(torch, "compile", compile_passthrough)
    optimized = convnets.optimize_for_inference(tiny_model())
    with pytest.raises(RuntimeError):
        optimized(torch.randn(2, 5, 32, 32))  # 5 channels: the eager module fails too
    assert optimized.compiled


def _torch_compile_raises(monkeypatch: pytest.MonkeyPatch, patch_inductor: Callable[..., None]) -> str:
    def broken_compile(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated: compiler backend missing")
    monkeypatch.setattr(torch, "compile", broken_compile)
    return "simulated: compiler backend missing"


def _no_cpp_compiler(monkeypatch: pytest.MonkeyPatch, patch_inductor: Callable[..., None]) -> str:
    patch_inductor({"cpp.cxx": ("convnets-test-no-such-compiler",)})
    assert compile_unavailable_reason(torch.device("cpu")) is not None
    return "unavailable"


@pytest.mark.parametrize("break_compilation", [_torch_compile_raises, _no_cpp_compiler])
def test_unavailable_compilation_means_eager_with_a_warning(break_compilation: Callable[..., str],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             patch_inductor: Callable[..., None],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    expected_message = break_compilation(monkeypatch, patch_inductor)
    model, x = tiny_model(), images()
    with caplog.at_level(logging.WARNING, logger="convnets.deploy.optimize"):
        optimized = convnets.optimize_for_inference(model)
    assert not optimized.compiled
    assert any(expected_message in r.getMessage() for r in caplog.records)
    assert max_rel_error(optimized(x), reference(model, x)) < 1e-4
