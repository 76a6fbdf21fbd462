"""What a run shows besides metrics.jsonl: TensorBoard events (rebuilt on resume, off with
--no-tensorboard), OUT/curves.png and ``convnets plot``, and a missing optional package.

The events and the figure of a full run are checked on test_train_loop.py's shared run.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from strict_skips import require_module
from train_support import TINY_ARCH, make_digits, one_thread, read_metrics

from convnets import cli
from convnets.commands.train import config_from_args
from convnets.errors import DataError, MissingDependencyError
from convnets.train import TrainConfig, fit
from convnets.train.curves import DPI, FIGSIZE, plot_curves
from convnets.train.metrics import read_metrics as read_metrics_file
from convnets.runtime import Precision
from convnets.train.tensorboard import TensorBoardLog

require_module("tensorboard", extra="tensorboard")
require_module("matplotlib", extra="plots")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

PNG_SIZE = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
MATPLOTLIB = ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_digits(tmp_path_factory.mktemp("digits"), n_train=128, n_val=64)


def tiny(digits: Path, output: Path, **changes: object) -> TrainConfig:
    settings: dict[str, object] = dict(data=digits, output=output, arch="resnet50", arch_kwargs=TINY_ARCH,
                                       image_size=32, batch_size=32, epochs=1, lr=0.1, workers=0, progress=False)
    return TrainConfig(**{**settings, **changes})


def scalars(directory: Path, accumulator: EventAccumulator | None = None) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of an event directory, read by TensorBoard's own reader."""
    ea = accumulator or EventAccumulator(str(directory))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_resume_rebuilds_the_events_from_the_checkpoint_history(digits: Path, tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "out"
    fit(tiny(digits, out, epochs=1))
    live = EventAccumulator(str(out / "tensorboard"))  # a TensorBoard left open during the run
    assert [s for s, _ in scalars(out, live)["val/top1"]] == [1]
    # Events past the checkpoint (a session that went further, then resumed from this checkpoint).
    # TensorBoard reads event files in name order: whole seconds, host, pid, then a per-process
    # counter compared as text ("10" < "9"). Sessions of a real run are processes seconds apart;
    # in one test process, a second between the writers keeps their files in session order.
    time.sleep(1.1)
    with SummaryWriter(str(out / "tensorboard")) as stale:
        stale.add_scalar("val/top1", -5.0, global_step=2)
        stale.add_scalar("val/top1", -5.0, global_step=3)
    time.sleep(1.1)
    fit(tiny(digits, out, epochs=2, resume=out / "checkpoint.pth.tar"))
    records = read_metrics(out)
    want = [(r["epoch"], pytest.approx(r["val_top1"], rel=1e-6)) for r in records]
    assert [r["epoch"] for r in records] == [1, 2]
    assert len(list((out / "tensorboard").iterdir())) == 3  # one file per session, nothing deleted
    assert scalars(out / "tensorboard")["val/top1"] == want
    assert scalars(out, live)["val/top1"] == want  # the open reader dropped the stale point too


def test_loss_scale_is_logged_when_fp16_scaling_is_on(digits: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # No fp16 training on a CPU: a CPU GradScaler on an fp32 run takes the scaler's code path.
    monkeypatch.setattr(Precision, "make_scaler", lambda self: torch.amp.GradScaler("cpu", init_scale=128.0))
    fit(tiny(digits, tmp_path, epochs=1))
    record = read_metrics(tmp_path)[0]
    assert record["loss_scale"] == 128.0
    assert scalars(tmp_path / "tensorboard")["train/loss_scale"] == [(1, 128.0)]


def test_no_tensorboard_writes_no_events(digits: Path, tmp_path: Path) -> None:
    args = cli.build_parser(["train"]).parse_args(["train", "--data", str(digits), "--output", str(tmp_path)])
    assert config_from_args(args).tensorboard is True
    args = cli.build_parser(["train"]).parse_args(["train", "--data", str(digits), "--output", "x", "--no-tensorboard"])
    assert config_from_args(args).tensorboard is False
    summary = fit(tiny(digits, tmp_path, tensorboard=False))
    assert summary.epochs == 1 and not (tmp_path / "tensorboard").exists()
    assert "loss_scale" not in read_metrics(tmp_path)[0]  # fp32 (or bf16) on a CPU: no scaler
    assert Image.open(tmp_path / "curves.png").size == PNG_SIZE


def test_missing_packages_cost_one_line_each_and_no_failure(digits: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    for name in ("tensorboard", "torch.utils.tensorboard", *MATPLOTLIB):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    with caplog.at_level(logging.WARNING, logger="convnets"):
        summary = fit(tiny(digits, tmp_path))
    assert summary.epochs == 1 and read_metrics(tmp_path)[0]["epoch"] == 1
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "curves.png").exists()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("TensorBoard" in m for m in lines) == 1 and sum("curves.png" in m for m in lines) == 1
    assert any("pip install -c constraints.txt -e '.[tensorboard]'" in m for m in lines)
    assert any("pip install -c constraints.txt -e '.[plots]'" in m for m in lines)


def _write_metrics(directory: Path, records: list[dict[str, object]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


RECORDS = [{"epoch": e, "train_loss": 2.0 / e, "val_loss": 2.5 / e, "val_top1": 20.0 * e, "val_top5": 90.0,
            "lr": 0.1} for e in (1, 2, 3)]


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_metrics(tmp_path / "run", RECORDS)
    for name in MATPLOTLIB:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependencyError, match=r"pip install -c constraints.txt -e '\.\[plots\]'"):
        plot_curves(RECORDS, tmp_path / "x.png")
    assert cli.main(["plot", str(run)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convnets plot: error: matplotlib is needed")
    assert "pip install -c constraints.txt -e '.[plots]'" in err[0] and not (run / "curves.png").exists()


def test_plot_errors_name_the_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 1
    assert "holds no metrics.jsonl" in capsys.readouterr().err
    assert cli.main(["plot", str(_write_metrics(tmp_path / "empty", []))]) == 1
    assert "no finished epoch" in capsys.readouterr().err
    bad = _write_metrics(tmp_path / "bad", RECORDS)
    (bad / "metrics.jsonl").write_text('{"epoch": 1}\nnot json\n')
    with pytest.raises(DataError, match="line 2"):
        read_metrics_file(bad / "metrics.jsonl")


def test_a_line_being_appended_is_left_out(tmp_path: Path) -> None:
    run = _write_metrics(tmp_path, RECORDS)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 4, "train_lo')
    assert read_metrics_file(run / "metrics.jsonl") == RECORDS


def test_curves_draw_what_the_records_hold(tmp_path: Path) -> None:
    records = [dict(r, train_top1=10.0 * r["epoch"]) for r in RECORDS]
    records[1]["train_loss"] = math.nan  # an epoch whose every step was skipped: a gap, no failure
    plot_curves(records, tmp_path / "c.png", title="run")
    with Image.open(tmp_path / "c.png") as image:
        assert image.format == "PNG" and image.size == PNG_SIZE
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    # matplotlib's first two colours (train, validation) are drawn; most of the figure is white.
    for colour in ((31, 119, 180), (255, 127, 14)):
        assert (np.abs(pixels - colour).sum(1) < 30).sum() > 100, colour
    assert (pixels == 255).all(1).mean() > 0.5
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, none left


class _Stop(Exception):
    pass


def test_print_freq_logs_training_scalars_at_global_steps_that_resume_continues(
        digits: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """--print-freq 2 with 4 steps per epoch: train/* at global steps 2, 4, 6, 8 in tensorboard/steps/,
    the same steps and losses whether the run was resumed or not, stale points of a killed session hidden."""
    from torch.utils.tensorboard import SummaryWriter

    args = cli.build_parser(["train"]).parse_args(["train", "--data", "d", "--output", "o", "--print-freq", "3"])
    assert config_from_args(args).print_freq == 3
    with pytest.raises(ValueError, match="print_freq"):
        TrainConfig(data=digits, output=tmp_path, print_freq=0)

    straight = tmp_path / "straight"
    with caplog.at_level(logging.INFO, logger="convnets.train.loop"):
        fit(tiny(digits, straight, epochs=2, print_freq=2))
    # No progress bar (progress=False): the same intervals as log lines.
    assert [m.split(":")[0] for m in caplog.messages if m.startswith("step ")] == ["step 2", "step 4", "step 6",
                                                                                  "step 8"]
    resumed = tmp_path / "resumed"
    add_record = TensorBoardLog.add_record

    def stop_after_epoch_1(self: TensorBoardLog, record: dict[str, object]) -> None:
        add_record(self, record)
        if record["epoch"] == 1:  # after epoch 1's checkpoint: a session stopped there
            raise _Stop

    with monkeypatch.context() as patch:
        patch.setattr(TensorBoardLog, "add_record", stop_after_epoch_1)
        with pytest.raises(_Stop):
            fit(tiny(digits, resumed, epochs=2, print_freq=2))
    time.sleep(1.1)  # event files are read in name order (whole seconds first): keep sessions in order
    with SummaryWriter(str(resumed / "tensorboard" / "steps")) as stale:  # a session killed in epoch 2
        stale.add_scalar("train/loss", -5.0, global_step=6)
    time.sleep(1.1)
    fit(tiny(digits, resumed, epochs=2, print_freq=2, resume=resumed / "checkpoint.pth.tar"))

    want = scalars(straight / "tensorboard" / "steps")
    assert set(want) == {"train/loss", "train/lr", "train/images_per_s"}
    assert [s for s, _ in want["train/loss"]] == [2, 4, 6, 8]
    got = scalars(resumed / "tensorboard" / "steps")
    for tag in ("train/loss", "train/lr"):
        assert got[tag] == [(s, pytest.approx(v, rel=1e-5)) for s, v in want[tag]], tag
    assert [s for s, _ in got["train/images_per_s"]] == [2, 4, 6, 8]
    assert all(v > 0 for _, v in got["train/images_per_s"])
    # Each epoch's two intervals of two steps average to the epoch's train_loss of metrics.jsonl.
    losses = [v for _, v in want["train/loss"]]
    for record, pair in zip(read_metrics(straight), (losses[:2], losses[2:])):
        assert record["train_loss"] == pytest.approx(sum(pair) / 2, rel=1e-5)
    # The per-epoch run is unchanged: step = epoch.
    assert [s for s, _ in scalars(straight / "tensorboard")["train/loss"]] == [1, 2]
