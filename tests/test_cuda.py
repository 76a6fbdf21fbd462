"""The GPU paths end to end: prediction, embeddings and training with mixed precision on CUDA.

Skipped where there is no CUDA GPU (CI has none); ``benchmarks/gpu_checks.sh`` runs this module on a
lent GPU. Each result is compared with an independent computation on the CPU in float32/float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, randomize_bn, run_cli
from test_embed import _independent
from test_predict_cli import EXAMPLES, SE, _expected_top
from train_support import make_digits, read_metrics, reference_top1, run_train, tiny_args

import convnets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, num_classes=5, **TINY[SE]))
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                "class_names": ["ant", "bee", "cat", "dog", "eel"]}, path)
    return path, model.state_dict()


# Probabilities of 5 classes against float32 on the CPU: TF32 convolutions round to ~1e-3, fp16 and
# bf16 to their 11 and 8 bits; a wrong normalisation, layout or device transfer moves them by ~0.1.
@pytest.mark.parametrize("precision,atol", [("fp32", 5e-3), ("fp16", 2e-2), ("bf16", 5e-2)])
def test_predict_on_cuda_matches_the_cpu_reference(tiny_checkpoint, precision: str, atol: float) -> None:
    path, state = tiny_checkpoint
    done = run_cli("predict", "--weights", str(path), "--device", "cuda", "--precision", precision,
                   "--json", "--topk", "5", *EXAMPLES)
    assert done.returncode == 0, done.stderr
    assert f"for {precision} on cuda" in done.stderr  # auto's one line: the model ran on the GPU
    for result, expected in zip(json.loads(done.stdout), _expected_top(state, EXAMPLES, 5), strict=True):
        got = {t["index"]: t["probability"] for t in result["top"]}
        np.testing.assert_allclose([got[i] for i, _ in expected], [p for _, p in expected], atol=atol)


def test_embed_on_cuda_matches_the_float64_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, **TINY[SE])).eval()
    paths = [str(REPO / f) for f in EXAMPLES]
    got = np.stack([v for _, v in convnets.embed(model, paths, device="cuda", batch_size=2)])
    expected = _independent(model, paths, 4, image_size=224)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine


def test_training_with_fp16_and_grad_scaler_learns_and_resumes(tmp_path: Path) -> None:
    data = make_digits(tmp_path / "data")
    out = tmp_path / "out"
    proc = run_train(*tiny_args(data, out, 8, "--device", "cuda"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert records[-1]["val_top1"] >= 90.0 and records[-1]["train_loss"] < records[0]["train_loss"] - 0.3
    ckpt = torch.load(out / "checkpoint.pth.tar", weights_only=True)
    assert ckpt["scaler"] is not None and ckpt["scaler"]["scale"] > 0  # fp16 autocast with a GradScaler
    model = convnets.load_model(out / "checkpoint.pth.tar")
    # The accuracy measured on the GPU under autocast agrees with fp32 on the CPU.
    assert abs(reference_top1(model, data / "val") - records[-1]["val_top1"]) <= 1.0

    proc = run_train(*tiny_args(data, out, 10, "--device", "cuda", "--resume", str(out / "checkpoint.pth.tar")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["epoch"] for r in read_metrics(out)] == list(range(1, 11))
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["scaler"] is not None
