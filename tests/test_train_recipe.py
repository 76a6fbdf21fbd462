"""The recipe's pieces, each checked against an independent computation (no run of the loop)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from train_support import one_thread

import convnets
from convnets.errors import TrainingDivergedError
from convnets.train import TrainConfig, Trainer
from convnets.runtime import Precision, resolve_precision
from convnets.train.recipe import make_optimizer, mixup

CPU_FP32 = Precision(torch.device("cpu"), None, torch.contiguous_format)
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def small_net() -> nn.Module:
    """Conv (no bias) + BN + conv with bias + linear: every kind of parameter the recipe sorts."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


# --- weight decay ----------------------------------------------------------------------------


def expected_decay(name: str, p: torch.Tensor) -> float:
    """Independent rule from names and shapes: conv (4-D) and linear (2-D) weights decay; biases,
    BN gamma/beta (stem bn1, block bn1..3, downsample.1) never."""
    is_bn = name.startswith("bn1.") or ".bn" in name or ".downsample.1." in name
    if name.endswith(".bias") or is_bn:
        return 0.0
    assert name.endswith(".weight") and p.dim() in (2, 4), name
    return 1 / 16384


def test_weight_decay_only_on_conv_and_linear_weights() -> None:
    model = convnets.get_model("se_resnext101_32x4d", layers=[1, 1, 1, 1], widths=[8, 16, 32, 64],
                               cardinality=4, se_squeeze=4, num_classes=5)
    optimizer = make_optimizer(model, 0.1)
    wd_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(wd_of) == len(named)  # every parameter is in exactly one group
    for name, p in named.items():
        assert wd_of[id(p)] == expected_decay(name, p), name
    # The three that upstream gets wrong are present and excluded.
    for name in ("layer1.0.downsample.1.weight", "layer1.0.downsample.1.bias", "layer1.0.squeeze.squeeze.bias",
                 "layer1.0.squeeze.expand.bias", "fc.bias"):
        assert wd_of[id(named[name])] == 0.0
    for name in ("layer1.0.squeeze.squeeze.weight", "fc.weight", "layer1.0.downsample.0.weight", "conv1.weight"):
        assert wd_of[id(named[name])] == 6.103515625e-05
    assert optimizer.defaults["momentum"] == 0.875


# --- learning-rate schedule ------------------------------------------------------------------


@pytest.mark.parametrize("warmup", [0, 4])
def test_lr_follows_linear_warmup_then_cosine(warmup: int) -> None:
    total, base = 20, 0.4
    trainer = Trainer(small_net(), CPU_FP32, lr=base, total_steps=total, warmup_steps=warmup)
    seen = []
    for s in range(total):  # the lr each real optimizer step uses (both parameter groups)
        lrs = {g["lr"] for g in trainer.optimizer.param_groups}
        assert len(lrs) == 1
        seen.append(lrs.pop())
        trainer.step([batch(seed=s)])
    for s, lr in enumerate(seen):
        if s < warmup:
            want = base * (s + 1) / warmup
        else:
            want = base / 2 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), s
    if warmup:
        assert seen[warmup - 1] == pytest.approx(base)


# --- loss: label smoothing, mixup --------------------------------------------------------------


def smoothed(targets: torch.Tensor, classes: int, eps: float = 0.1) -> torch.Tensor:
    return F.one_hot(targets, classes).double() * (1 - eps) + eps / classes


def soft_ce(logits: torch.Tensor, target_dist: torch.Tensor) -> torch.Tensor:
    return -(target_dist * F.log_softmax(logits.double(), dim=1)).sum(1).mean()


def test_loss_is_label_smoothed_by_0_1() -> None:
    assert TrainConfig(output="x", data_backend="synthetic").label_smoothing == 0.1
    trainer = Trainer(small_net().eval(), CPU_FP32, lr=0.1, total_steps=1)
    x, y = batch()
    with torch.no_grad():
        loss = trainer.loss(x, y)
        want = soft_ce(trainer.model(x), smoothed(y, 3))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_mixup_blends_images_and_pairs_targets() -> None:
    x = torch.randn(16, 3, 4, 4)
    y = torch.arange(16)  # distinct targets reveal the pairing
    mixed, ya, yb, lam = mixup(x, y, 0.2, np.random.default_rng(3))
    assert 0.0 <= lam <= 1.0
    assert torch.equal(ya, y)
    assert sorted(yb.tolist()) == list(range(16))
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x[yb])
    lams = [mixup(x, y, 0.2, np.random.default_rng(s))[3] for s in range(400)]
    # Beta(0.2, 0.2) is U-shaped: most mass near 0 and 1, mean 1/2.
    assert np.mean([lam < 0.1 or lam > 0.9 for lam in lams]) > 0.5
    assert abs(np.mean(lams) - 0.5) < 0.06


def test_mixup_loss_is_cross_entropy_on_mixed_smoothed_targets() -> None:
    net = small_net().eval()
    with torch.no_grad():
        net[-1].weight.mul_(50)  # confident outputs, so that mixing visibly changes the loss
    trainer = Trainer(net, CPU_FP32, lr=0.1, total_steps=1, mixup_alpha=0.2)
    x, y = batch(16)
    with torch.no_grad():
        loss = trainer.loss(x, y, np.random.default_rng(7))
        mixed, ya, yb, lam = mixup(x, y, 0.2, np.random.default_rng(7))  # the same draws
        want = soft_ce(net(mixed), lam * smoothed(ya, 3) + (1 - lam) * smoothed(yb, 3))
        plain = soft_ce(net(x), smoothed(y, 3))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert abs(loss.item() - plain.item()) > 1e-2


# --- EMA, accumulation, non-finite steps ---------------------------------------------------------


def test_ema_follows_the_recurrence_over_weights_and_bn_statistics() -> None:
    decay = 0.6
    trainer = Trainer(small_net(), CPU_FP32, lr=0.5, total_steps=5, ema_decay=decay)
    ema: dict[str, torch.Tensor] = {}
    for step in range(4):
        trainer.step([batch(seed=step)])
        current = {k: v.detach().clone().double() for k, v in trainer.model.state_dict().items()
                   if v.is_floating_point()}
        ema = current if step == 0 else {k: decay * ema[k] + (1 - decay) * current[k] for k in current}
    got = trainer.ema.module.state_dict()
    assert "1.running_mean" in ema
    for k, v in ema.items():
        torch.testing.assert_close(got[k].double(), v, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(got["0.weight"], trainer.model.state_dict()["0.weight"])


def test_gradient_accumulation_equals_one_large_batch() -> None:
    # No BatchNorm here: its batch statistics legitimately differ between 2x8 and 1x16 images.
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    x, y = batch(16)
    big = Trainer(net(), CPU_FP32, lr=0.5, total_steps=2)
    big.step([(x, y)])
    accumulated = Trainer(net(), CPU_FP32, lr=0.5, total_steps=2)
    accumulated.step([(x[:8], y[:8]), (x[8:], y[8:])])
    for (name, a), b in zip(big.model.state_dict().items(), accumulated.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_non_finite_steps_are_skipped_then_training_stops() -> None:
    trainer = Trainer(small_net(), CPU_FP32, lr=0.1, total_steps=10, max_nonfinite_steps=3)
    x, y = batch()
    trainer.step([(x, y)])
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    poisoned = x.clone()
    poisoned[0, 0, 0, 0] = float("nan")
    for _ in range(2):
        result = trainer.step([(poisoned, y)])
        assert result.skipped and math.isnan(result.loss)
    after = trainer.model.state_dict()
    for k in before:  # skipped: no NaN reached the weights or the BatchNorm statistics
        assert torch.equal(before[k], after[k]), k
    assert not trainer.step([(x, y)]).skipped  # a finite step resets the count
    trainer.step([(poisoned, y)])
    trainer.step([(poisoned, y)])
    with pytest.raises(TrainingDivergedError, match="3 optimizer steps in a row"):
        trainer.step([(poisoned, y)])


# --- precision defaults ------------------------------------------------------------------------


def test_precision_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = resolve_precision(torch.device("cuda"))
    assert (cuda.amp_dtype, cuda.use_scaler, cuda.memory_format) == (torch.float16, True, torch.channels_last)
    cuda_bf16 = resolve_precision(torch.device("cuda"), amp_dtype="bf16")
    assert (cuda_bf16.amp_dtype, cuda_bf16.use_scaler) == (torch.bfloat16, False)
    assert resolve_precision(torch.device("cuda"), amp=False).amp_dtype is None
    monkeypatch.setattr("convnets.machine.cpu_bf16_speedup", lambda: 2.9)  # measured faster: mixed precision
    cpu = resolve_precision(torch.device("cpu"))
    assert (cpu.amp_dtype, cpu.use_scaler, cpu.memory_format) == (torch.bfloat16, False, torch.channels_last)
    monkeypatch.setattr("convnets.machine.cpu_bf16_speedup", lambda: 0.6)  # measured slower: fp32
    cpu = resolve_precision(torch.device("cpu"))
    assert (cpu.amp_dtype, cpu.memory_format) == (None, torch.contiguous_format)
    assert resolve_precision(torch.device("cpu"), memory_format="nhwc").memory_format == torch.channels_last
    with pytest.raises(ValueError, match="bf16"):
        resolve_precision(torch.device("cpu"), amp=True, amp_dtype="fp16")


# The measurement itself (convnets.machine.cpu_bf16_speedup) is tested in test_machine.py.


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        TrainConfig(data="d", output="o", batch_size=0)
    with pytest.raises(ValueError, match="evaluate needs weights"):
        TrainConfig(data="d", evaluate=True)
    with pytest.raises(ValueError, match="data_backend"):
        TrainConfig(data="d", output="o", data_backend="tfrecord")
