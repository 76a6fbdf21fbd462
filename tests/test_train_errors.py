"""Every way a user can get ``convnets train`` wrong ends in one clear line and a non-zero exit
status, never a traceback. Each case runs the command line's ``main`` in this process (what
``python -m convnets.train`` runs: its parsing, checks and messages, without a PyTorch start-up per case);
tests/test_cli_startup.py runs the real process for the mistakes refused before PyTorch loads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import cli_in_process
from train_support import TINY_ARCH, make_digits, run_train, tiny_args

import convnets
import convnets.train
from convnets.cli import build_parser
from convnets.commands.train import add_arguments, config_from_args

Case = Callable[[Path, Path], list[str]]  # (digits, scratch dir) -> CLI arguments


def _data_without_images(d: Path, tmp: Path) -> list[str]:
    for split in ("train", "val"):
        (tmp / "empty" / split / "cat").mkdir(parents=True)
    return tiny_args(tmp / "empty", tmp / "out", 1)


def _mismatched_classes(d: Path, tmp: Path) -> list[str]:
    shutil.copytree(d, tmp / "data")
    shutil.rmtree(tmp / "data" / "val" / "digit3")
    shutil.copytree(tmp / "data" / "val" / "digit2", tmp / "data" / "val" / "digit9")
    return tiny_args(tmp / "data", tmp / "out", 1)


def _training_checkpoint(path: Path, **arch: object) -> Path:
    """A minimal checkpoint in the format of ``convnets train`` for another architecture."""
    model = convnets.get_model("resnet50", num_classes=4, **arch)
    torch.save({"state_dict": model.state_dict(), "optimizer": {}, "scheduler": {}, "epoch": 1, "arch": "resnet50",
                "arch_spec": model.spec.to_dict(), "class_names": [f"digit{i}" for i in range(4)]}, path)
    return path


OTHER_ARCH = dict(TINY_ARCH, widths=[8, 16, 32, 64])

# A --data, --weights or --resume that does not exist is a usage error, refused before PyTorch loads:
# tests/test_cli_startup.py (PATH_MISTAKES).
CASES: dict[str, tuple[Case, str]] = {
    "data directory without train/": (
        lambda d, t: tiny_args(d / "val", t / "out", 1), "{d}/val/train is not a directory; --data must hold"),
    "data directory without images": (_data_without_images, "{t}/empty/train has no usable images"),
    "train and val classes differ": (
        _mismatched_classes, "only in train: ['digit3'], only in val: ['digit9']"),
    "fewer images than a batch": (
        lambda d, t: tiny_args(d, t / "out", 1, "--batch-size", "1000"), "fewer than one batch of 1000"),
    "misspelt architecture": (
        lambda d, t: tiny_args(d, t / "out", 1, "--arch", "resnet05"),
        f"unknown model 'resnet05'; choose one of: {', '.join(convnets.list_models())}"),
    "unknown architecture field": (
        lambda d, t: tiny_args(d, t / "out", 1, "--arch-kwargs", '{"depth": 18}'), "--arch-kwargs: "),
    "a backbone instead of a classifier": (
        lambda d, t: tiny_args(d, t / "out", 1, "--arch-kwargs", json.dumps(dict(TINY_ARCH, features_only=True))),
        "--arch-kwargs: features_only and out_indices build a backbone without a classifier"),
    "resume from another architecture": (
        lambda d, t: tiny_args(d, t / "out", 1, "--resume", str(_training_checkpoint(t / "other.pth", **OTHER_ARCH))),
        "was trained as resnet50"),
    "fine-tune from another architecture's weights": (
        lambda d, t: tiny_args(d, t / "out", 1, "--pretrained-from-file",
                               str(_training_checkpoint(t / "other.pth", **OTHER_ARCH))), "does not fit resnet50"),
    "resume from a plain state dict": (
        lambda d, t: (torch.save(convnets.get_model("resnet50", **TINY_ARCH).state_dict(), t / "sd.pth"),
                      tiny_args(d, t / "out", 1, "--resume", str(t / "sd.pth")))[1],
        "is not a convnets training checkpoint"),
    "output of another run": (
        lambda d, t: ((t / "out").mkdir(), (t / "out" / "checkpoint.pth.tar").write_bytes(b"x"),
                      tiny_args(d, t / "out", 1))[2], "already holds checkpoint.pth.tar of another run; continue it "
                                                     "with --resume {t}/out/checkpoint.pth.tar or choose another --output"),
    "evaluate without weights": (
        lambda d, t: ["--data", str(d), "--evaluate"], "evaluate needs weights"),
    "diverging loss": (
        lambda d, t: tiny_args(d, t / "out", 1, "--lr", "1e30", "--no-amp", "--batch-size", "4"),
        "training diverged: 10 optimizer steps in a row"),
}
if not torch.cuda.is_available():
    CASES["cuda without a GPU"] = (lambda d, t: tiny_args(d, t / "out", 1, "--device", "cuda"), "no CUDA GPU")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess[str], str]]:
    digits = make_digits(tmp_path_factory.mktemp("digits"), n_train=64, n_val=16)
    done = {}
    for name, (case, message) in CASES.items():
        scratch = tmp_path_factory.mktemp("case")
        args = case(digits, scratch)
        done[name] = (cli_in_process("train", *args), message.format(d=digits, t=scratch))
    return done


@pytest.mark.parametrize("case", list(CASES))
def test_error_is_one_clear_line(case: str, outcomes: dict[str, tuple[subprocess.CompletedProcess[str], str]]) -> None:
    proc, message = outcomes[case]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("convnets train: error: ") and message in lines[-1], lines[-1]
    # A diverging run may first warn once that it skipped a step; nothing else comes before.
    assert len(lines) == 1 or (case == "diverging loss" and len(lines) == 2 and "skipped optimizer step" in lines[0])
    assert proc.stdout == ""


def test_bad_arch_kwargs_json_is_a_usage_error(tmp_path: Path) -> None:
    proc = run_train("--data", str(tmp_path), "--output", str(tmp_path), "--arch-kwargs", "{layers: [1]}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--arch-kwargs is not valid JSON" in proc.stderr.strip().splitlines()[-1]
    # The valid spelling used elsewhere in these tests reaches the configuration unchanged.
    args = build_parser().parse_args(["train", "--data", str(tmp_path), "--output", str(tmp_path),
                                      "--arch-kwargs", json.dumps(TINY_ARCH)])
    assert config_from_args(args).arch_kwargs == TINY_ARCH


def test_every_config_field_has_a_flag(tmp_path: Path) -> None:
    """``convnets train`` flags are generated from TrainConfig: each field is reachable from the CLI."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(convnets.train.TrainConfig)} <= dests
    args = build_parser().parse_args(["train", "--data", str(tmp_path), "--output", str(tmp_path),
                                      "--max-nonfinite-steps", "3", "--no-amp", "--memory-format", "nhwc",
                                      "--no-progress", "--ema", "0.5", "--pretrained"])
    config = config_from_args(args)
    assert (config.max_nonfinite_steps, config.amp, config.memory_format, config.progress, config.ema,
            config.pretrained, config.data) == (3, False, "channels_last", False, 0.5, True, tmp_path)
    assert config_from_args(build_parser().parse_args(["train", "--data", "d", "--output", "o"])) == \
        convnets.train.TrainConfig(data="d", output="o")  # the flags' defaults are the config's


def _wrong_momentum(ckpt: dict) -> None:
    ckpt["optimizer"]["state"][0]["momentum_buffer"] = torch.zeros(3)


def _wrong_python_rng(ckpt: dict) -> None:
    ckpt["rng"]["python"]["state"] = [1, 2, 3]


def _python_rng_out_of_range(ckpt: dict) -> None:
    ckpt["rng"]["python"]["state"][-1] = 10 ** 6  # the index into the 624 words, which random.setstate checks


def _numpy_rng_out_of_range(ckpt: dict) -> None:
    ckpt["rng"]["numpy"]["pos"] = 10 ** 6


#: name -> (how the checkpoint of a finished first epoch is damaged, what the error names)
DAMAGED: dict[str, tuple[Callable[[dict], None], str]] = {
    "momentum buffer of another shape": (_wrong_momentum, "optimizer['state'][0]['momentum_buffer'] (a tensor of"),
    "learning rate that is a string": (lambda c: c["optimizer"]["param_groups"][0].update(lr="fast"),
                                       "optimizer['param_groups'][0]['lr'] (str, expected a number)"),
    "scheduler base_lrs that is a string": (lambda c: c["scheduler"].update(base_lrs="x"),
                                            "scheduler['base_lrs'] (str, expected a list of"),
    "torch generator state of another size": (lambda c: c["rng"].update(torch=torch.zeros(10, dtype=torch.uint8)),
                                              "rng['torch'] (a torch.uint8 tensor of shape [10], expected"),
    "python generator state of another size": (_wrong_python_rng, "rng['python']['state'] (a list of 3, expected"),
    "numpy generator position out of range": (_numpy_rng_out_of_range, "rng['numpy']['pos'] (1000000, expected 0 to "
                                                                        "624)"),
    "python generator index out of range": (_python_rng_out_of_range, "rng (invalid state)"),
    "history that is a number": (lambda c: c.update(history=5), "history (5, expected a list of dicts"),
    "an absurd epoch": (lambda c: c.update(epoch=10 ** 18), "records 1000000000000000000 completed epochs, more than "
                                                             "--epochs 2"),
}


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The data and the checkpoint of a real one-epoch run."""
    from convnets.train import TrainConfig, fit

    data = make_digits(tmp_path_factory.mktemp("digits"), n_train=64, n_val=16)
    out = tmp_path_factory.mktemp("run")
    fit(TrainConfig(data=data, output=out, epochs=1, arch="resnet50", arch_kwargs=TINY_ARCH, image_size=32,
                    batch_size=32, workers=0, amp=False, lr=0.1, progress=False))
    return data, torch.load(out / "checkpoint.pth.tar", weights_only=True)


@pytest.mark.parametrize("case", list(DAMAGED))
def test_resume_validates_every_entry_it_restores(case: str, first_epoch: tuple[Path, dict], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    from convnets.cli import main

    data, good = first_epoch
    damage, words = DAMAGED[case]
    ckpt = copy.deepcopy(good)
    damage(ckpt)
    path = tmp_path / "damaged.pth.tar"
    torch.save(ckpt, path)
    monkeypatch.delenv("CONVNETS_DEBUG", raising=False)
    # In this process: a traceback would be an exception here (rather than a line on stderr).
    assert main(["train", *tiny_args(data, tmp_path / "out", 2, "--resume", str(path))]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("convnets train: error: "), lines
    assert str(path) in lines[0] and words in lines[0], lines[0]
