"""The training loop end to end on real images: it learns, and what it writes is right and usable."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from strict_skips import require_module
from torchvision import transforms
from conftest import cli_in_process, run_cli
from train_support import (N_TRAIN, N_VAL, REPO, TINY_ARCH, cli_env, make_digits, one_thread, read_metrics,
                           reference_top1, run_train, tiny_args)

import convnets
from convnets.train import TrainConfig, fit

EPOCHS = 12
STEPS_PER_EPOCH = N_TRAIN // 32
CLASSES = ["digit0", "digit1", "digit2", "digit3"]
pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_digits(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def trained(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real CLI run shared by the tests below: 12 epochs with EMA, default precision."""
    out = tmp_path_factory.mktemp("run") / "out"
    proc = run_train(*tiny_args(digits, out, EPOCHS, "--ema", "0.9"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return out, proc.stdout


def test_cli_training_learns_digits(trained: tuple[Path, str], digits: Path) -> None:
    out, stdout = trained
    val_counts = [len(list((digits / "val" / c).iterdir())) for c in CLASSES]
    assert max(val_counts) / sum(val_counts) < 0.3  # a constant prediction scores under 30%
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == list(range(1, EPOCHS + 1))
    assert records[-1]["val_top1"] >= 90.0
    assert records[0]["val_top1"] < 60.0
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.3
    assert records[-1]["ema_val_top1"] >= 85.0
    assert stdout.strip().splitlines()[-1].startswith(f"trained {EPOCHS} epochs")


def test_metrics_record_every_epoch(trained: tuple[Path, str]) -> None:
    out, _ = trained
    base, warmup, total = 0.1, STEPS_PER_EPOCH, EPOCHS * STEPS_PER_EPOCH
    for r in read_metrics(out):
        assert {"epoch", "train_loss", "val_loss", "val_top1", "val_top5", "lr", "img_per_s", "epoch_seconds",
                "ema_val_loss", "ema_val_top1", "ema_val_top5", "unreadable_images"} <= set(r)
        assert r["train_images"] == STEPS_PER_EPOCH * 32 and r["val_images"] == N_VAL
        assert r["val_top5"] == 100.0  # 4 classes
        assert 0 <= r["val_top1"] <= 100 and r["img_per_s"] > 0 and r["epoch_seconds"] > 0
        # The lr of the epoch's last optimizer step, from the closed form (warmup 1 epoch, cosine).
        s = r["epoch"] * STEPS_PER_EPOCH - 1
        want = base * (s + 1) / warmup if s < warmup else \
            base / 2 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup)))
        assert r["lr"] == pytest.approx(want, rel=1e-9)


def test_checkpoint_is_self_describing(trained: tuple[Path, str], digits: Path) -> None:
    out, _ = trained
    ckpt = torch.load(out / "checkpoint.pth.tar", weights_only=True)
    assert {"state_dict", "state_dict_ema", "optimizer", "scheduler", "scaler", "epoch", "rng", "config", "arch",
            "arch_spec", "class_names", "best_top1", "history"} <= set(ckpt)
    assert ckpt["epoch"] == EPOCHS and ckpt["arch"] == "resnet50" and ckpt["scaler"] is None
    assert ckpt["class_names"] == CLASSES
    assert convnets.ArchSpec(**ckpt["arch_spec"]) == convnets.get_model("resnet50", **TINY_ARCH).spec
    assert ckpt["config"]["arch_kwargs"] == TINY_ARCH and ckpt["config"]["ema"] == 0.9
    assert ckpt["scheduler"]["last_epoch"] == EPOCHS * STEPS_PER_EPOCH
    assert not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert {g["weight_decay"] for g in ckpt["optimizer"]["param_groups"]} == {0.0, 1 / 16384}

    model = convnets.load_model(out / "checkpoint.pth.tar")
    assert model.class_names == CLASSES and model.num_classes == 4
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ckpt["state_dict"][k], msg=k)
    # The metrics' accuracy (bf16 autocast where the CPU has it) agrees with an fp32 reference.
    assert abs(reference_top1(model, digits / "val") - ckpt["history"][-1]["val_top1"]) <= 1.0
    ema = convnets.load_model(out / "checkpoint.pth.tar", use_ema=True)
    assert not torch.equal(ema.fc.weight, model.fc.weight)

    best = torch.load(out / "model_best.pth.tar", weights_only=True)
    top1s = [r["val_top1"] for r in read_metrics(out)]
    assert best["epoch"] == top1s.index(max(top1s)) + 1 and best["best_top1"] == max(top1s)


def test_model_best_safetensors_rebuilds_the_best_model_alone(trained: tuple[Path, str], digits: Path) -> None:
    from safetensors import safe_open

    out, _ = trained
    best = torch.load(out / "model_best.pth.tar", weights_only=True)
    from_pth = convnets.load_model(out / "model_best.pth.tar")
    from_st = convnets.load_model(out / "model_best.safetensors")
    assert from_st.spec == from_pth.spec and from_st.num_classes == 4
    assert from_st.class_names == from_pth.class_names == CLASSES
    assert from_st.input_size == from_pth.input_size == 32
    batch = torch.stack([transforms.ToTensor()(Image.open(p).convert("RGB"))
                         for p in sorted((digits / "val" / "digit2").iterdir())[:8]])
    # The run trained channels_last, and torch.save keeps those strides; safetensors stores every
    # tensor contiguous. Same values (checked below), so the same layout gives the same logits.
    from_pth.to(memory_format=torch.contiguous_format)
    with torch.no_grad():
        assert torch.equal(from_st(batch), from_pth(batch))

    # Read back independently of convnets: the best epoch's model weights (not the EMA's) and the
    # metadata that make the file self-describing.
    with safe_open(str(out / "model_best.safetensors"), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert json.loads(metadata["arch_spec"]) == best["arch_spec"]
    assert json.loads(metadata["class_names"]) == CLASSES and metadata["image_size"] == "32"
    assert tensors.keys() == best["state_dict"].keys()
    for k, v in best["state_dict"].items():
        assert torch.equal(tensors[k], v), k
    assert not torch.equal(tensors["fc.weight"], best["state_dict_ema"]["fc.weight"])


def test_evaluate_reports_the_checkpoint_accuracy(trained: tuple[Path, str], digits: Path) -> None:
    out, _ = trained
    last = read_metrics(out)[-1]
    proc = cli_in_process("train", "--evaluate", "--resume", str(out / "checkpoint.pth.tar"), "--data", str(digits),
                          "--image-size", "32", "--batch-size", "50", "--workers", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert f"evaluated {N_VAL} images" in line
    assert f"top-1 {last['val_top1']:.2f}%" in line and f"EMA top-1 {last['ema_val_top1']:.2f}%" in line


def test_fine_tuning_from_a_file_keeps_the_backbone_and_replaces_the_head(
        trained: tuple[Path, str], digits: Path, tmp_path: Path) -> None:
    three = tmp_path / "three"
    for split in ("train", "val"):
        for c in CLASSES[:3]:
            shutil.copytree(digits / split / c, three / split / c)
    source = torch.load(trained[0] / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    summary = fit(TrainConfig(data=three, output=tmp_path / "out", arch="resnet50", arch_kwargs=TINY_ARCH,
                              pretrained_from_file=trained[0] / "checkpoint.pth.tar", image_size=32, batch_size=32,
                              epochs=1, lr=1e-9, workers=0, progress=False))
    tuned = torch.load(summary.checkpoint, weights_only=True)
    assert tuned["class_names"] == CLASSES[:3] and tuned["state_dict"]["fc.weight"].shape == (3, 128)
    torch.testing.assert_close(tuned["state_dict"]["layer3.0.conv2.weight"], source["layer3.0.conv2.weight"])


def test_unreadable_images_are_skipped_and_counted(digits: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(digits, data)
    train_files = sorted((data / "train" / "digit1").iterdir())
    for bad in (train_files[3], train_files[10], sorted((data / "val" / "digit2").iterdir())[0]):
        bad.write_bytes(b"this is not an image")
    (data / "train" / "digit3" / "truncated.png").write_bytes(
        (digits / "train" / "digit3").iterdir().__next__().read_bytes()[:40])
    out = tmp_path / "out"
    proc = cli_in_process("train", *tiny_args(data, out, 1, "--batch-size", "49"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("skipping unreadable image") == 4
    record = read_metrics(out)[0]
    # 481 training files in 9 batches of 49 = 441 draws: all 3 bad ones if drawn, 1 in validation.
    assert 1 <= record["unreadable_images"] <= 4
    assert record["val_images"] == N_VAL - 1 and record["train_images"] == 9 * 49
    assert f"{record['unreadable_images']} unreadable images skipped" in proc.stdout
    assert Image.open(sorted((data / "val" / "digit0").iterdir())[0]).size == (32, 32)


def test_gradient_accumulation_scales_the_default_lr(digits: Path, tmp_path: Path) -> None:
    summary = fit(TrainConfig(data=digits, output=tmp_path, arch="resnet50", arch_kwargs=TINY_ARCH, image_size=32,
                              batch_size=16, grad_accum=2, epochs=1, workers=0, progress=False))
    ckpt = torch.load(summary.checkpoint, weights_only=True)
    assert ckpt["step"] == N_TRAIN // 32  # 30 micro-batches of 16 -> 15 optimizer steps
    assert ckpt["scheduler"]["base_lrs"] == [0.256 * 32 / 256] * 2  # optimizer batch 16 x 2 = 32
    assert summary.metrics["train_images"] == N_TRAIN


def test_synthetic_backend_needs_no_data(tmp_path: Path) -> None:
    summary = fit(TrainConfig(data_backend="synthetic", output=tmp_path, arch="resnet50", arch_kwargs=TINY_ARCH,
                              image_size=32, batch_size=8, epochs=1, progress=False))
    assert summary.metrics["img_per_s"] > 0 and summary.metrics["train_images"] == 64 * 8
    assert len(torch.load(summary.checkpoint, weights_only=True)["class_names"]) == 1000


def test_pretrained_weights_come_through_the_verified_cache_with_a_new_head(digits: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A local mirror stands in for NGC: a full ResNet-50 under the manifest's file name.
    mirror, cache = tmp_path / "mirror", tmp_path / "torch_home"
    mirror.mkdir()
    torch.manual_seed(1)
    ngc = convnets.get_model("resnet50").state_dict()
    torch.save(ngc, mirror / "nvidia_resnet50_200821.pth.tar")
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(mirror))
    monkeypatch.setenv("TORCH_HOME", str(cache))
    small = tmp_path / "small"
    for split, n in (("train", 32), ("val", 8)):
        for c in CLASSES:
            (small / split / c).mkdir(parents=True)
            for f in sorted((digits / split / c).iterdir())[: n // 4]:
                shutil.copy(f, small / split / c)
    summary = fit(TrainConfig(data=small, output=tmp_path / "out", arch="resnet50", pretrained=True, image_size=32,
                              batch_size=16, epochs=1, lr=1e-9, workers=0, progress=False))
    assert (cache / "hub" / "checkpoints" / "nvidia_resnet50_200821.pth.tar").is_file()
    tuned = torch.load(summary.checkpoint, weights_only=True)["state_dict"]
    assert tuned["fc.weight"].shape == (4, 2048)
    torch.testing.assert_close(tuned["layer4.2.conv3.weight"], ngc["layer4.2.conv3.weight"])


def test_predict_cli_uses_the_training_checkpoint(trained: tuple[Path, str], digits: Path) -> None:
    """`convnets predict --weights` takes a training checkpoint: its class names and image size."""
    out, _ = trained
    files = sorted((digits / "val").glob("*/*.png"))[::10]
    done = cli_in_process("predict", "--weights", str(out / "model_best.pth.tar"), "--json", "--topk", "1",
                          *map(str, files))
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["input"] for r in results] == [str(f) for f in files]
    assert {r["top"][0]["label"] for r in results} <= set(CLASSES)
    correct = sum(r["top"][0]["label"] == Path(r["input"]).parent.name for r in results)
    assert correct / len(results) >= 0.85


def test_tensorboard_events_equal_the_metrics(trained: tuple[Path, str]) -> None:
    """The event files, read by TensorBoard's own reader, hold metrics.jsonl's numbers (float32)."""
    require_module("tensorboard", extra="tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = trained
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    keys = {"train/loss": "train_loss", "train/lr": "lr", "train/images_per_s": "img_per_s", "val/loss": "val_loss",
            "val/top1": "val_top1", "val/top5": "val_top5", "ema_val/loss": "ema_val_loss",
            "ema_val/top1": "ema_val_top1", "ema_val/top5": "ema_val_top5"}
    assert set(ea.Tags()["scalars"]) == set(keys)  # no train/loss_scale: no fp16 loss scaling here
    records = read_metrics(out)
    for tag, key in keys.items():
        assert [(e.step, e.value) for e in ea.Scalars(tag)] == [
            (r["epoch"], pytest.approx(r[key], rel=1e-6)) for r in records], tag


def _curve_pixels(png: Path) -> np.ndarray:
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1000, 400)
        return np.asarray(image.convert("RGB"))


def test_curves_are_drawn_at_the_end_and_by_convnets_plot(trained: tuple[Path, str], tmp_path: Path) -> None:
    require_module("matplotlib", extra="plots")
    out, _ = trained
    pixels = _curve_pixels(out / "curves.png")
    flat = pixels.reshape(-1, 3).astype(int)
    for colour in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):  # train, validation, EMA validation
        assert (np.abs(flat - colour).sum(1) < 30).sum() > 100, colour
    # `convnets plot` in a fresh process: the same figure, and no PyTorch imported.
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "convnets", "plot", str(out), "--output",
                           str(tmp_path / "again.png")], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tmp_path / "again.png")
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "matplotlib" in imported and not any(m == "torch" or m.startswith("torch.") for m in imported)
    assert np.array_equal(_curve_pixels(tmp_path / "again.png"), pixels)


#: ``python -c`` that runs ``convnets ARGS`` on two cores (this process's first two): a 2-core machine.
ON_TWO_CORES = ("import os, runpy, sys; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2]); "
                "sys.argv[0] = 'convnets'; runpy.run_module('convnets', run_name='__main__')")


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_train_and_evaluate_on_two_cores_start_as_many_loaders_as_predict(digits: Path, tmp_path: Path) -> None:
    """Without --workers, no PyTorch warning that the loader's processes outnumber the cores, and the summary says
    which precision validation ran in."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    out = tmp_path / "out"
    args = [a for a in tiny_args(digits, out, 1, "--no-amp") if a not in ("--workers", "0")]
    assert "--workers" not in args
    trained = run_cli("train", *args, code=ON_TWO_CORES, env=cli_env(1))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "worker" not in trained.stderr, trained.stderr[-3000:]
    summary = trained.stdout.strip().splitlines()[-1]
    top1 = read_metrics(out)[-1]["val_top1"]
    assert summary.startswith(f"trained 1 epochs in ") and f": val top-1 {top1:.2f}% (fp32) (best " in summary, summary
    evaluated = run_cli("evaluate", "--weights", str(out / "checkpoint.pth.tar"), "--data", str(digits / "val"),
                        "--device", "cpu", code=ON_TWO_CORES, env=cli_env(1))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "worker" not in evaluated.stderr, evaluated.stderr[-3000:]
    assert "fp32 on cpu" in evaluated.stdout, evaluated.stdout
