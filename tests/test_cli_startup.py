"""The command line parses before it imports PyTorch: help and usage errors answer at once.

Each case runs ``python -X importtime -m convnets ...`` in a fresh process and reads the list of
imported modules from the interpreter's own report, so nothing here depends on timing.
benchmarks/bench_cli.py measures the time itself.
"""

from __future__ import annotations

import os
from pathlib import Path
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
    # Counts are checked while parsing; only --topk's upper limit (the model's classes) waits for the model.
    (["predict", "--topk", "0", "x.jpg"], "argument --topk: must be a positive integer, got '0'"),
    (["predict", "--topk", "-3", "x.jpg"], "argument --topk: must be a positive integer, got '-3'"),
    (["predict", "--topk", "two", "x.jpg"], "argument --topk: must be a positive integer, got 'two'"),
    (["embed", "--batch-size", "0", "--output", "v.npy", "x.jpg"], "argument --batch-size: must be a positive"),
    (["evaluate", "--data", "d", "--workers", "-1"], "argument --workers: must be a non-negative integer"),
    (["export", "--random-init", "--model", "resnet50", "--triton", "--max-batch-size", "0", "--output", "out"],
     "argument --max-batch-size: must be a positive integer of at most 4096, got '0'"),
    (["train", "--epochs", "0"], "argument --epochs: must be a positive integer, got '0'"),
    (["train", "--workers", "-1"], "argument --workers: must be a non-negative integer, got '-1'"),
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


def test_the_constants_the_command_line_needs_are_defined_once() -> None:
    """``convnets.constants`` is the one module-level assignment of each of its names (a copy kept
    elsewhere to spare --help an import could drift from it), and it imports nothing."""
    import ast

    from convnets import constants

    tree = ast.parse(Path(constants.__file__).read_text(encoding="utf-8"))
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.module != "__future__"]
    names = set(constants.__all__)
    copies = []
    for path in sorted((REPO / "convnets").rglob("*.py")):
        if path.name == "constants.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            copies += [f"{path.relative_to(REPO)}:{node.lineno} {t.id}" for t in targets
                       if isinstance(t, ast.Name) and t.id.lstrip("_") in names]
    assert copies == []
