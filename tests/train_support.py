"""Shared helpers for the ``test_train_*`` modules: a small real image data set and CLI runners.

Imported by the ``test_train_*`` modules (pytest puts this directory on ``sys.path``).

The data set is scikit-learn's 8x8 handwritten digits (real scans), upscaled to 32x32 PNG files
in ImageFolder layout: small enough to train on 2 CPU cores in seconds, hard enough that only a
network that learns scores well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import datasets, transforms

REPO = Path(__file__).resolve().parents[1]

#: A ResNet-50 shrunk to ~245k parameters: one block per stage, narrow stages.
TINY_ARCH: dict[str, Any] = {"layers": [1, 1, 1, 1], "widths": [16, 32, 64, 128], "expansion": 1, "stem_width": 16}
DIGITS = (0, 1, 2, 3)
N_TRAIN, N_VAL = 480, 201  # 15 batches of 32; an odd validation set, so DDP ranks get unequal shares


def make_digits(root: Path, n_train: int = N_TRAIN, n_val: int = N_VAL, size: int = 32,
                digits: tuple[int, ...] = DIGITS) -> Path:
    """Write ``root/{train,val}/digit{k}/{i}.png`` for ``digits`` (default 0-3) and return ``root``.

    All ten digits hold 1797 images (0-3: 720); ``n_train + n_val`` must not exceed that.
    """
    from sklearn.datasets import load_digits

    loaded = load_digits()
    keep = np.isin(loaded.target, digits)
    images, labels = loaded.images[keep], loaded.target[keep]
    order = np.random.default_rng(0).permutation(len(labels))
    for split, chosen in (("train", order[:n_train]), ("val", order[n_train:n_train + n_val])):
        for i in chosen:
            folder = root / split / f"digit{labels[i]}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (images[i] * (255 / 16)).astype(np.uint8)
            Image.fromarray(pixels).resize((size, size), Image.BILINEAR).convert("RGB").save(folder / f"{i:04d}.png")
    return root


def tiny_args(data: Path, output: Path, epochs: int, *extra: str, lr: str | None = "0.1") -> list[str]:
    """``convnets train`` options for the tiny architecture on the digits, single-threaded loading."""
    return ["--data", str(data), "--output", str(output), "--arch", "resnet50", "--arch-kwargs",
            json.dumps(TINY_ARCH), "--image-size", "32", "--batch-size", "32", "--epochs", str(epochs),
            *(["--lr", lr] if lr else []), "--warmup-epochs", "1", "--workers", "0", "--no-progress", *extra]


def cli_env(threads: int = 1) -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout importable, a fixed number of threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    env.pop("CONVNETS_DEBUG", None)
    return env


def train_cmd(*args: str) -> list[str]:
    """``python -m convnets.train ARGS``."""
    return [sys.executable, "-m", "convnets.train", *args]


def run_train(*args: str, timeout: float = 300, threads: int = 1) -> subprocess.CompletedProcess[str]:
    """Run ``python -m convnets.train ARGS`` to completion and capture its output."""
    import forked_cli  # a real process, forked from an interpreter that has imported torch (tests/forked_cli.py)

    return forked_cli.run(list(args), env=cli_env(threads), cwd=REPO, timeout=timeout, module="convnets.train")


def read_metrics(output: Path) -> list[dict[str, Any]]:
    """The records of ``output/metrics.jsonl``."""
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """In-process training on one thread: two threads on two shared cores stall each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_top1(model: torch.nn.Module, val_dir: Path) -> float:
    """Accuracy by a plain torchvision pipeline in fp32, independent of the training package."""
    tf = transforms.Compose([transforms.Resize(round(32 * 256 / 224)), transforms.CenterCrop(32),
                             transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    data = datasets.ImageFolder(str(val_dir), transform=tf)
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    return 100 * correct / len(data)
