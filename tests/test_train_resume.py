"""A run killed mid-training and resumed from its last checkpoint ends exactly where an
uninterrupted run ends: weights, EMA weights, optimizer, schedule, metrics and global random state."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from train_support import (REPO, TINY_ARCH, cli_env, make_digits, one_thread, read_metrics, run_train, tiny_args,
                           train_cmd)

from convnets.train import TrainConfig, fit

EPOCHS = 3
# MixUp and EMA on, so that their random draws and state are part of what must be restored.
EXTRA = ("--mixup", "0.2", "--ema", "0.9")


def kill_after_first_checkpoint(args: list[str], checkpoint: Path, timeout: float = 180) -> None:
    """Start a real training process and SIGKILL it as soon as its first checkpoint exists."""
    proc = subprocess.Popen(train_cmd(*args), cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        while not checkpoint.exists():
            if proc.poll() is not None:
                pytest.fail(f"training ended before its first checkpoint: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint appeared in time")
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no chance to clean up: as a crash or a pre-empted job
    finally:
        proc.kill()
        proc.communicate()


def test_killed_and_resumed_run_matches_uninterrupted_run(tmp_path: Path) -> None:
    data = make_digits(tmp_path / "data", n_train=192, n_val=64)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    proc = run_train(*tiny_args(data, whole, EPOCHS, *EXTRA))
    assert proc.returncode == 0, proc.stderr[-2000:]

    # Loader workers differ on purpose: augmentation is seeded per sample, not per process.
    kill_after_first_checkpoint(tiny_args(data, broken, EPOCHS, *EXTRA, "--workers", "2"),
                                broken / "checkpoint.pth.tar")
    interrupted_at = torch.load(broken / "checkpoint.pth.tar", weights_only=True)["epoch"]
    assert 1 <= interrupted_at < EPOCHS
    assert len(read_metrics(broken)) <= interrupted_at + 1
    proc = run_train(*tiny_args(data, broken, EPOCHS, *EXTRA, "--resume", str(broken / "checkpoint.pth.tar")))
    assert proc.returncode == 0, proc.stderr[-2000:]

    a = torch.load(whole / "checkpoint.pth.tar", weights_only=True)
    b = torch.load(broken / "checkpoint.pth.tar", weights_only=True)
    assert a["epoch"] == b["epoch"] == EPOCHS and a["step"] == b["step"]
    for key in ("state_dict", "state_dict_ema"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=0, atol=1e-5, msg=f"{key} {name}")
    for pid, state in a["optimizer"]["state"].items():
        torch.testing.assert_close(b["optimizer"]["state"][pid]["momentum_buffer"], state["momentum_buffer"],
                                   rtol=0, atol=1e-5)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"] and a["scaler"] == b["scaler"] and a["ema_updates"] == b["ema_updates"]
    # metrics.jsonl of the resumed run holds each epoch once, with the uninterrupted run's values.
    timing = {"img_per_s", "epoch_seconds"}
    strip = [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(broken)]
    assert strip == [{k: v for k, v in r.items() if k not in timing} for r in read_metrics(whole)]


def _seed_globals(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _global_draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]


@pytest.mark.usefixtures(one_thread.__name__)
def test_resume_restores_the_global_random_generators(tmp_path: Path) -> None:
    """After a resume, the torch / numpy / ``random`` global generators continue as in an uninterrupted run."""
    data = make_digits(tmp_path / "data", n_train=64, n_val=16)
    common = dict(data=data, arch="resnet50", arch_kwargs=TINY_ARCH, image_size=32, batch_size=32, workers=0,
                  amp=False, lr=0.1, progress=False)
    _seed_globals(123)
    fit(TrainConfig(output=tmp_path / "whole", epochs=2, **common))
    expected = _global_draws()

    _seed_globals(123)
    fit(TrainConfig(output=tmp_path / "part", epochs=1, **common))
    _seed_globals(999)  # as a new process would start: other states everywhere
    fit(TrainConfig(output=tmp_path / "part", epochs=2, resume=tmp_path / "part" / "checkpoint.pth.tar", **common))
    assert _global_draws() == expected
