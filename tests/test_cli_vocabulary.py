"""One command-line vocabulary: shared options, train's upstream aliases, registry-built choices, --output/--json."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import REPO

from convnets.cli import COMMANDS, build_parser, main
from convnets.commands import options
from convnets.commands.train import config_from_args
from convnets.deploy import engines as engine_registry
from convnets.deploy.engines import Engine

if TYPE_CHECKING:
    import torch
    from torch import nn

ONE_BLOCK = json.dumps(dict(layers=[1], widths=[16], cardinality=4, stem_width=16))


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser([argv[0]]).parse_args(list(argv))


def _action(command: str, option: str) -> argparse.Action:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in sub.choices[command]._actions if option in a.option_strings)


# --- train: upstream's spellings are aliases of the shared options --------------------------------

def test_train_aliases_set_what_the_shared_options_set(tmp_path: Path) -> None:
    base = ("train", "--data", str(tmp_path), "--output", str(tmp_path))
    upstream = config_from_args(_parse(*base, "--arch", "se-resnext101-32x4d", "--pretrained-from-file", "w.pth",
                                       "--amp"))
    shared = config_from_args(_parse(*base, "--model", "se_resnext101_32x4d", "--weights", "w.pth", "--amp"))
    assert upstream == shared
    assert (shared.arch, shared.pretrained_from_file, shared.amp, shared.amp_dtype) == \
        ("se_resnext101_32x4d", Path("w.pth"), True, None)


@pytest.mark.parametrize("argv, amp, amp_dtype", [
    ((), None, None),  # where it helps
    (("--precision", "fp32"), False, None),
    (("--no-amp",), False, None),
    (("--precision", "bf16"), True, "bf16"),
    (("--amp-dtype", "fp16"), True, "fp16"),
])
def test_train_precision_maps_to_the_amp_settings(tmp_path: Path, argv: tuple[str, ...], amp: bool | None,
                                                  amp_dtype: str | None) -> None:
    config = config_from_args(_parse("train", "--data", str(tmp_path), "--output", str(tmp_path), *argv))
    assert (config.amp, config.amp_dtype) == (amp, amp_dtype)


def test_train_precision_and_amp_together_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        _parse("train", "--data", "d", "--output", "o", "--amp", "--precision", "fp32")
    assert done.value.code == 2
    assert "argument --precision/--amp-dtype: not allowed with argument --amp/--no-amp" in capsys.readouterr().err


def test_train_help_lists_the_aliases() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "convnets", "train", "--help"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in ("--model NAME, --arch NAME", "--weights FILE, --pretrained-from-file FILE", "--amp, --no-amp",
                 "--precision {fp32,bf16,fp16}, --amp-dtype {fp32,bf16,fp16}", "--output DIR", "--image-size PX"):
        assert line in proc.stdout, line
    assert "--amp = mixed precision (fp16 on CUDA, bf16 on CPUs" in " ".join(proc.stdout.split())


# --- one definition per option ---------------------------------------------------------------------

@pytest.mark.parametrize("command", ["predict", "embed", "train", "export", "benchmark"])
def test_image_size_is_one_bounded_pixels_option(command: str) -> None:
    assert _action(command, "--image-size").type is options.pixels


@pytest.mark.parametrize("command, metavar", [("predict", "FILE"), ("embed", "FILE"), ("train", "DIR"),
                                              ("export", "DIR"), ("evaluate", "DIR"), ("benchmark", "FILE"),
                                              ("plot", "PNG")])
def test_output_names_what_is_written(command: str, metavar: str) -> None:
    assert _action(command, "--output").metavar == metavar


def test_model_option_takes_upstreams_spelling_everywhere() -> None:
    assert _parse("export", "--model", "se-resnext101-32x4d", "--output", "o").model == "se_resnext101_32x4d"
    assert _parse("train", "--arch", "se-resnext101-32x4d").arch == "se_resnext101_32x4d"


# --- engine and format choices come from the registries ----------------------------------------------

class DummyEngine(Engine):
    name = "dummy"
    description = "a test engine that runs nothing"
    devices = ("cpu",)
    precisions = ("fp32",)
    requires = ("dummy_runtime",)
    extra = "dummy"

    def build(self, model: nn.Module, precision: str, device: torch.device, *, compile: bool) -> nn.Module:
        raise NotImplementedError


@pytest.fixture
def dummy_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_registry.ENGINES, "_items", dict(engine_registry.ENGINES._items))
    engine_registry.register_engine(DummyEngine())


@pytest.mark.parametrize("command", ["predict", "benchmark"])
def test_a_registered_engine_is_a_choice_with_its_help_line(dummy_engine: None, command: str) -> None:
    action = _action(command, "--engine")
    assert "dummy" in action.choices  # type: ignore[operator]
    assert "dummy (a test engine that runs nothing; cpu; fp32; extra: dummy)" in (action.help or "")
    assert _parse(command, "--engine", "dummy", *(["x.jpg"] if command == "predict" else [])).engine == "dummy"


def test_without_it_the_engine_is_no_choice() -> None:
    assert "dummy" not in _action("predict", "--engine").choices  # type: ignore[operator]
    assert _action("benchmark", "--engine").choices == (*engine_registry.engine_names(), "auto", "all")


def test_every_command_that_offers_engine_or_format_lists_every_registered_one() -> None:
    from convnets.deploy.formats import export_formats

    for engine in engine_registry.engines():
        assert engine.help_line() in (_action("predict", "--engine").help or "")
    for fmt in export_formats():
        assert fmt.help_line() in (_action("export", "--format").help or "")


# --- --json prints on stdout, --output writes --------------------------------------------------------

BENCH = ["benchmark", "--model", "resnet50", "--arch-kwargs", ONE_BLOCK, "--device", "cpu", "--no-compile",
         "--batch-sizes", "2", "--warmup", "1", "--iterations", "1", "--image-size", "32"]


def test_benchmark_json_prints_the_report_and_output_writes_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main([*BENCH, "--json", "--output", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)  # the JSON alone: no table
    assert printed == json.loads(out.read_text())
    assert printed["config"]["batch_sizes"] == [2] and printed["results"][0]["batch_size"] == 2
    assert main([*BENCH, "--output", str(out), "--force"]) == 0  # the file of the first run, replaced as asked
    assert "img/s" in capsys.readouterr().out  # the table, and the file
    assert json.loads(out.read_text())["config"]["image_size"] == 32


def test_every_json_option_prints_json() -> None:
    for command in COMMANDS:
        try:
            action = _action(command, "--json")
        except StopIteration:
            continue
        assert "as JSON on stdout" in (action.help or ""), command
