"""Two processes under ``torchrun`` on CPU (gloo): one set of files from rank 0, metrics of the
whole data set, and errors reported by every rank. The launcher and its ranks are forked from an
interpreter that has imported PyTorch (``forked_cli.torchrun``)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import forked_cli
import pytest
import torch
from safetensors.torch import load_file
from train_support import REPO, TINY_ARCH, cli_env, make_digits, one_thread, read_metrics, tiny_args

from convnets.dist import DistContext
from convnets.train import TrainConfig, fit
from convnets.data.dali import _epoch_order
from convnets.data.folders import SeededSampler

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    # One thread per process: two processes share the two cores.
    return forked_cli.torchrun(["--standalone", "--nproc_per_node", "2", "-m", "convnets.train", *args],
                               env=cli_env(threads=1), cwd=REPO, timeout=300)


def test_two_process_run_writes_once_and_averages_over_ranks(tmp_path: Path) -> None:
    data = make_digits(tmp_path / "data", n_train=192, n_val=81)  # 81: the ranks get 41 and 40
    out = tmp_path / "out"
    proc = torchrun(*tiny_args(data, out, 2, "--batch-size", "16", "--no-amp", "--ema", "0.9", lr=None))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("trained 2 epochs") == 1  # the summary comes from rank 0 only
    records = read_metrics(out)
    assert [r["epoch"] for r in records] == [1, 2]  # one line per epoch: only rank 0 writes
    assert all(r["train_images"] == 192 and r["val_images"] == 81 for r in records)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pth.tar", "curves.png", "metrics.jsonl",
                                                     "model_best.pth.tar", "model_best.safetensors", "tensorboard"]
    events = list((out / "tensorboard").iterdir())
    assert len(events) == 1 and events[0].name.startswith("events.out.tfevents.")  # rank 0's writer only
    # Under DDP too, model_best.safetensors holds model_best's unwrapped weights (no "module." prefix).
    best = torch.load(out / "model_best.pth.tar", weights_only=True)["state_dict"]
    saved = load_file(out / "model_best.safetensors")
    assert saved.keys() == best.keys() and all(torch.equal(saved[k], best[k]) for k in best)
    ckpt = torch.load(out / "checkpoint.pth.tar", weights_only=True)
    assert ckpt["world_size"] == 2
    assert ckpt["scheduler"]["base_lrs"] == [0.256 * 32 / 256] * 2  # global batch 2 x 16
    assert ckpt["step"] == 2 * 192 // 32

    # Rank-summed validation equals one process evaluating the same weights on all 81 images.
    single = fit(TrainConfig(data=data, evaluate=True, resume=out / "checkpoint.pth.tar", image_size=32,
                             batch_size=16, workers=0, amp=False, progress=False))
    assert single.metrics["images"] == 81
    for prefix in ("val", "ema_val"):
        assert single.metrics[f"{prefix}_top1"] == pytest.approx(records[-1][f"{prefix}_top1"], abs=1e-9)
        assert single.metrics[f"{prefix}_top5"] == pytest.approx(records[-1][f"{prefix}_top5"], abs=1e-9)
        assert single.metrics[f"{prefix}_loss"] == pytest.approx(records[-1][f"{prefix}_loss"], rel=1e-5)


def test_every_rank_reports_an_error_and_the_job_fails(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = torchrun("--data", str(tmp_path / "empty"), "--output", str(tmp_path / "out"),
                    "--arch-kwargs", str(TINY_ARCH).replace("'", '"'))
    assert proc.returncode != 0
    for rank in (0, 1):
        assert f"convnets train: error: rank {rank}/2: {tmp_path / 'empty' / 'train'} is not a directory" \
            in proc.stderr
    assert not (tmp_path / "out" / "checkpoint.pth.tar").exists()


# Data order of a rank, without a process group: the PyTorch sampler and DALI's file order.
N_IMAGES = 192


def _ctx(rank: int) -> DistContext:
    return DistContext(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))


def _sampler_order(rank: int, epoch: int, n: int = N_IMAGES) -> list[int]:
    sampler = SeededSampler(list(range(n)), _ctx(rank), seed=7)
    sampler.set_epoch(epoch)
    return [index for index, _ in sampler]


def _dali_order(rank: int, epoch: int, n: int = N_IMAGES) -> list[int]:
    return _epoch_order(n, 7, epoch, _ctx(rank))


@pytest.mark.parametrize("order", [_sampler_order, _dali_order], ids=["pytorch", "dali"])
def test_two_ranks_partition_the_data_in_a_new_order_each_epoch(order: Callable[..., list[int]]) -> None:
    shards = []
    for epoch in (0, 1, 2):
        a, b = order(0, epoch), order(1, epoch)
        assert len(a) == len(b) == N_IMAGES // 2
        assert not set(a) & set(b), f"epoch {epoch}: {len(set(a) & set(b))} images on both ranks"
        assert sorted(a + b) == list(range(N_IMAGES)), f"epoch {epoch}: the ranks miss images"
        shards.append((a, b))
    for rank in (0, 1):  # each epoch reshuffles which images a rank sees, and their order
        assert set(shards[0][rank]) != set(shards[1][rank]) != set(shards[2][rank])
    # With padding (an odd count), every image is still seen, one of them twice.
    a, b = order(0, 0, N_IMAGES + 1), order(1, 0, N_IMAGES + 1)
    assert set(a) | set(b) == set(range(N_IMAGES + 1)) and len(a) == len(b) == N_IMAGES // 2 + 1


def test_both_backends_train_on_the_same_order() -> None:
    for rank in (0, 1):
        for epoch in (0, 1):
            assert _sampler_order(rank, epoch) == _dali_order(rank, epoch)
