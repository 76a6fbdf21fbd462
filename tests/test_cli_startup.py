"""The command line parses before it imports PyTorch: help and usage errors answer at once.

Each case runs ``python -X importtime -m convnets ...`` in a fresh process and reads the list of
imported modules from the interpreter's own report, so nothing here depends on timing.
benchmarks/bench_cli.py measures the time itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from convnets.cli import COMMANDS, build_parser

#: Modules that a help or usage error must not import (each costs seconds or pulls in PyTorch).
HEAVY = ("torch", "torchvision", "numpy", "convnets.registry")


def _run_timed_imports(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "convnets", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "convnets.cli" in imported, proc.stderr[-2000:]  # the report is there at all
    return proc, imported


def _heavy(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if any(m == h or m.startswith(h + ".") for h in HEAVY))


LIGHT_COMMANDS = [name for name in COMMANDS if name != "train"]


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in LIGHT_COMMANDS)],
                         ids=lambda a: " ".join(a))
def test_help_imports_no_torch(args: list[str]) -> None:
    proc, imported = _run_timed_imports(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: convnets" in proc.stdout
    assert _heavy(imported) == []


@pytest.mark.parametrize("args, message", [
    (["predict", "--model", "resnet05", "x.jpg"], "invalid choice: 'resnet05'"),
    (["predict"], "the following arguments are required: INPUT"),
    (["benchmark", "--memory-format", "nwhc"], "choose contiguous or channels_last"),
    (["export", "--device", "cpu", "--output", "out"], "unrecognized arguments: --device"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_usage_errors_import_no_torch(args: list[str], message: str) -> None:
    proc, imported = _run_timed_imports(*args)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and message in lines[-1], lines
    assert _heavy(imported) == []


def test_help_shows_the_shared_options() -> None:
    proc, _ = _run_timed_imports("benchmark", "--help")
    for option in ("--model", "--weights", "--pretrained", "--random-init", "--arch-kwargs", "--device",
                   "--precision", "--memory-format"):
        assert option in proc.stdout, option


def test_train_help_imports_no_torch() -> None:
    proc, imported = _run_timed_imports("train", "--help")
    assert proc.returncode == 0
    assert _heavy(imported) == []


def test_every_command_builds_and_parses_its_options() -> None:
    parser = build_parser()  # every command module imported, every option added
    for name in COMMANDS:
        action = next(a for a in parser._subparsers._group_actions)  # type: ignore[union-attr]
        assert action.choices[name]._actions[1:], f"{name} added no options"  # type: ignore[index]


def test_torch_free_copies_agree_with_their_sources() -> None:
    """Constants spelled out in the command modules (so that --help needs no PyTorch) match their homes."""
    from convnets.commands import weights as weights_command
    from convnets.weights.download import MIRROR_ENV

    assert weights_command.MIRROR_ENV == MIRROR_ENV
