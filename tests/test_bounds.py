"""Sizes from files and the command line are bounded before anything is allocated.

A checkpoint cannot run code, but a mistaken or hostile one could still record sizes that exhaust
memory (an image size of 100000, an ``arch_spec`` of 300000 blocks, a nested or million-entry
list); so could a typo on the command line. Each must end in one error line that names the file
and its entry (or the option) and the limit, never in a traceback, a ``MemoryError`` or 24 GB of RSS.
The command-line cases run in real subprocesses under a 4 GB address-space limit.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import save_file

import convnets
from convnets.cli import main
from convnets.constants import MAX_BATCH_SIZE, MAX_IMAGE_SIZE
from convnets.errors import CheckpointError, DataError, InvalidArgumentError
from convnets.evaluation.data import find_eval_samples
from convnets.fileio import atomic_write
from convnets.models.specs import MAX_BLOCKS, MAX_CHANNELS, MAX_STAGES, ArchSpec
from convnets.preprocessing.presets import EvalPreset
from convnets.weights.safetensors_io import save_safetensors

IMAGE = REPO / "convnets" / "assets" / "examples" / "rocket.jpg"
MEMORY_LIMIT = 4 << 30  # bytes of address space for each command: PyTorch fits, 24 GB of RSS does not
TINY_SPEC = {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64], "expansion": 4, "cardinality": 1,
             "se_squeeze": None, "stem_width": 8}


def _self_nested() -> list:
    inner: list = [1]
    inner.append(inner)
    return inner


def _deeply_nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", num_classes=10, **{k: v for k, v in TINY_SPEC.items()
                                                              if k not in ("expansion", "cardinality", "se_squeeze")})
    return {k: v.contiguous() for k, v in model.state_dict().items()}


#: name -> (how to write the hostile file, what the error must name)
def _pth(**entries: object) -> Callable[[dict, Path], None]:
    def write(sd: dict, path: Path) -> None:
        torch.save({"state_dict": sd, "arch_spec": TINY_SPEC, **entries}, path)
    return write


def _st(**metadata: str) -> Callable[[dict, Path], None]:
    def write(sd: dict, path: Path) -> None:
        save_file(sd, str(path), metadata={"format": "pt", "arch_spec": json.dumps(TINY_SPEC), **metadata})
    return write


HOSTILE: dict[str, tuple[str, Callable[[dict, Path], None], tuple[str, ...]]] = {
    "image size in config": (".pth", _pth(config={"image_size": 100000}),
                             ("'config'", "image_size", "100000", str(MAX_IMAGE_SIZE))),
    "layers 300000": (".pth", _pth(arch_spec={**TINY_SPEC, "layers": [300000, 1, 1, 1]}),
                      ("'arch_spec'", "layers", str(MAX_BLOCKS))),
    "blocks adding up": (".pth", _pth(arch_spec={**TINY_SPEC, "layers": [600, 600, 1, 1]}),
                         ("'arch_spec'", "layers", "1202 blocks", str(MAX_BLOCKS))),
    "self-nested layers": (".pth", _pth(arch_spec={**TINY_SPEC, "layers": _self_nested()}),
                           ("'arch_spec'", "layers", "positive integers")),
    "deeply nested layers": (".pth", _pth(arch_spec={**TINY_SPEC, "layers": _deeply_nested(150)}),
                             ("'arch_spec'", "layers", "positive integers")),
    "100000 stages": (".pth", _pth(arch_spec={**TINY_SPEC, "layers": [1] * 100000, "widths": [8] * 100000}),
                      ("'arch_spec'", "100000 entries", f"at most {MAX_STAGES} stages")),
    "huge widths": (".pth", _pth(arch_spec={**TINY_SPEC, "widths": [10 ** 30] * 4}),
                    ("'arch_spec'", "widths", str(MAX_CHANNELS))),
    "huge stem": (".pth", _pth(arch_spec={**TINY_SPEC, "stem_width": 2 ** 70}),
                  ("'arch_spec'", "stem_width", str(MAX_CHANNELS))),
    "huge se_squeeze": (".pth", _pth(arch_spec={**TINY_SPEC, "se_squeeze": 10 ** 6}),
                        ("'arch_spec'", "se_squeeze", str(MAX_CHANNELS))),
    "huge expansion": (".pth", _pth(arch_spec={**TINY_SPEC, "expansion": 10 ** 9}), ("'arch_spec'", "expansion")),
    "layers as a string": (".pth", _pth(arch_spec={**TINY_SPEC, "layers": "1111"}),
                           ("'arch_spec'", "layers", "list of integers")),
    "safetensors image size": (".safetensors", _st(image_size="100000"),
                               ("image_size", "100000", str(MAX_IMAGE_SIZE))),
    "safetensors 5000-digit image size": (".safetensors", _st(image_size="9" * 5000),
                                          ("image_size", str(MAX_IMAGE_SIZE))),
    "safetensors layers 300000": (".safetensors", _st(arch_spec=json.dumps({**TINY_SPEC, "layers": [300000, 1, 1, 1]})),
                                  ("'arch_spec'", "layers", str(MAX_BLOCKS))),
    "safetensors JSON nested 100000 deep": (".safetensors",
                                            _st(arch_spec='{"layers": ' + "[" * 100000 + "]" * 100000 + "}"),
                                            ("metadata", "nested too deeply")),
}


@pytest.fixture(scope="module")
def hostile_files(state: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    files = {}
    for i, (name, (suffix, write, _)) in enumerate(HOSTILE.items()):
        files[name] = folder / f"case{i}{suffix}"
        write(state, files[name])
    return files


def _check_line(message: str, path: Path, names: tuple[str, ...]) -> None:
    assert str(path) in message, message
    for word in names:
        assert word in message, (word, message)
    assert len(message) < 600 and "\n" not in message, message


@pytest.mark.parametrize("case", list(HOSTILE))
def test_load_model_refuses_hostile_sizes(case: str, hostile_files: dict[str, Path]) -> None:
    path = hostile_files[case]
    with pytest.raises(CheckpointError) as info:
        convnets.load_model(path)
    _check_line(str(info.value), path, HOSTILE[case][2])


def test_get_model_refuses_a_recorded_image_size_too(hostile_files: dict[str, Path]) -> None:
    path = hostile_files["image size in config"]
    with pytest.raises(CheckpointError, match=str(MAX_IMAGE_SIZE)) as info:
        convnets.get_model("resnet50", pretrained_from_file=path, **{k: v for k, v in TINY_SPEC.items()
                                                                     if k != "se_squeeze"})
    assert str(path) in str(info.value)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CONVNETS_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "convnets", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120, preexec_fn=_limit_memory)


def _one_error_line(result: subprocess.CompletedProcess[str], status: int = 1) -> str:
    assert result.returncode == status, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0]


# Each CLI run imports PyTorch (seconds): the cases that reach the loader by different paths.
@pytest.mark.parametrize("case", ["image size in config", "layers 300000", "self-nested layers", "100000 stages",
                                  "safetensors image size", "safetensors JSON nested 100000 deep"])
def test_predict_refuses_hostile_checkpoints_in_one_line(case: str, hostile_files: dict[str, Path]) -> None:
    path = hostile_files[case]
    line = _one_error_line(_cli("predict", "--weights", str(path), str(IMAGE)))
    assert line.startswith("convnets predict: error: ")
    _check_line(line, path, HOSTILE[case][2])


@pytest.mark.parametrize("args, option, limit", [
    (["predict", "--image-size", "10000000000000", str(IMAGE)], "--image-size", MAX_IMAGE_SIZE),
    (["export", "--random-init", "--model", "resnet50", "--output", "out", "--image-size", "100000"],
     "--image-size", MAX_IMAGE_SIZE),
    (["benchmark", "--model", "resnet50", "--batch-sizes", "100000"], "--batch-sizes", MAX_BATCH_SIZE),
    (["benchmark", "--model", "resnet50", "--batch-sizes", "1,16," + "9" * 5000], "--batch-sizes", MAX_BATCH_SIZE),
])
def test_sizes_on_the_command_line_are_usage_errors(args: list[str], option: str, limit: int,
                                                     tmp_path: Path) -> None:
    line = _one_error_line(_cli(*args, cwd=tmp_path), status=2)
    assert f"argument {option}:" in line and str(limit) in line, line
    assert list(tmp_path.iterdir()) == []


def test_empty_batch_size_entries_are_usage_errors() -> None:
    line = _one_error_line(_cli("benchmark", "--model", "resnet50", "--batch-sizes", "1,,2"), status=2)
    assert "argument --batch-sizes:" in line and "1,,2" in line, line


def _flat_image(folder: Path) -> None:
    shutil.copy(IMAGE, folder / "ILSVRC2012_val_00000001.JPEG")


def test_kaggle_csv_with_a_huge_field(tmp_path: Path) -> None:
    _flat_image(tmp_path)
    csv_path = tmp_path / "LOC_val_solution.csv"
    csv_path.write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,n01440764 " + "1" * 200_000 + "\n")
    with pytest.raises(DataError, match="LOC_val_solution.csv") as info:
        find_eval_samples(tmp_path, class_names=None, num_classes=1000)
    assert str(csv_path) in str(info.value) and "field limit" in str(info.value)
    line = _one_error_line(_cli("evaluate", "--random-init", "--model", "resnet50", "--arch-kwargs",
                                json.dumps({"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}),
                                "--data", str(tmp_path)))
    assert str(csv_path) in line, line


@pytest.mark.parametrize("content", [b"garbage" * 100, "pickled int"])
def test_garbage_meta_bin(content: bytes | str, tmp_path: Path) -> None:
    _flat_image(tmp_path)
    meta = tmp_path / "meta.bin"
    if isinstance(content, bytes):
        meta.write_bytes(content)
    else:
        torch.save(5, meta)
    with pytest.raises(DataError) as info:
        find_eval_samples(tmp_path, class_names=None, num_classes=1000)
    assert str(meta) in str(info.value) and "meta.bin" in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_garbage_meta_bin_on_the_command_line(tmp_path: Path) -> None:
    _flat_image(tmp_path)
    (tmp_path / "meta.bin").write_bytes(b"\x80\x04garbage" * 100)
    line = _one_error_line(_cli("evaluate", "--random-init", "--model", "resnet50", "--arch-kwargs",
                                json.dumps({"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}),
                                "--data", str(tmp_path)))
    assert str(tmp_path / "meta.bin") in line, line


# --- the bounds themselves -------------------------------------------------------------------------


def test_arch_spec_bounds_allow_the_deepest_published_resnets() -> None:
    ArchSpec(layers=(111, 111, 111), widths=(16, 32, 64), expansion=4)  # ResNet-1001 (333 blocks)
    ArchSpec(layers=(3, 24, 36, 3), widths=(64, 128, 256, 512), expansion=4)  # ResNet-200
    ArchSpec(layers=(1,) * MAX_STAGES, widths=(MAX_CHANNELS,) * MAX_STAGES, expansion=1, stem_width=MAX_CHANNELS)


@pytest.mark.parametrize("overrides, words", [
    ({"layers": range(10 ** 12)}, "at most 16 stages"),
    ({"layers": [MAX_BLOCKS + 1, 1, 1, 1]}, f"at most {MAX_BLOCKS}"),
    ({"widths": [8, 16, 32, MAX_CHANNELS + 1]}, f"at most {MAX_CHANNELS}"),
    ({"cardinality": 2 ** 40}, f"at most {MAX_CHANNELS}"),
    ({"expansion": 65}, "at most 64"),
    ({"layers": [10 ** 5000, 1, 1, 1]}, "an integer of"),
])
def test_arch_spec_bounds(overrides: dict, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words) as info:
        ArchSpec(**{**TINY_SPEC, **overrides})
    assert len(str(info.value)) < 400


def test_random_init_arch_kwargs_are_bounded_too() -> None:
    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_BLOCKS}"):
        convnets.get_model("resnet50", layers=[300000, 1, 1, 1])


def test_presets_and_save_safetensors_bound_the_image_size(tmp_path: Path) -> None:
    assert EvalPreset.for_image_size(MAX_IMAGE_SIZE).crop_size == MAX_IMAGE_SIZE
    for bad in (MAX_IMAGE_SIZE + 1, 10 ** 13):
        with pytest.raises(InvalidArgumentError, match=str(MAX_IMAGE_SIZE)):
            EvalPreset.for_image_size(bad)
    with pytest.raises(InvalidArgumentError, match="resize_size"):
        EvalPreset(crop_size=224, resize_size=10 ** 13)
    with pytest.raises(InvalidArgumentError, match=str(MAX_IMAGE_SIZE)):
        save_safetensors({"w": torch.zeros(1)}, tmp_path / "x.safetensors", image_size=100000)
    assert list(tmp_path.iterdir()) == []


# --- the command line's last line of defence -------------------------------------------------------


@pytest.mark.parametrize("error", [MemoryError(), OverflowError("signed integer is greater than maximum"),
                                   SystemError("error return without exception set"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 4398046511104 bytes.")])
def test_cli_reports_exhausted_memory_in_one_line(error: Exception, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import convnets.commands.predict as predict

    def fail(args: object) -> int:
        raise error
    monkeypatch.delenv("CONVNETS_DEBUG", raising=False)
    monkeypatch.setattr(predict, "prepare", lambda args, stack: lambda: fail(args))
    assert main(["predict", str(IMAGE)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convnets predict: error: "), err
    assert type(error).__name__ in err and "--image-size" in err and "CONVNETS_DEBUG" in err


def test_cli_still_shows_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    import convnets.commands.predict as predict

    def fail(args: object) -> int:
        raise RuntimeError("an internal invariant")
    monkeypatch.setattr(predict, "prepare", lambda args, stack: lambda: fail(args))
    with pytest.raises(RuntimeError, match="invariant"):
        main(["predict", str(IMAGE)])


# --- full disks ------------------------------------------------------------------------------------


def test_enospc_names_the_destination(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(f: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "model.safetensors", full)
    assert info.value.errno == errno.ENOSPC and str(tmp_path / "model.safetensors") in str(info.value)

    def no_fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "b.bin", lambda f: f.write(b"x"))
    assert info.value.errno == errno.ENOSPC and str(tmp_path / "b.bin") in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_open_failures_name_the_destination_not_the_temporary_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        atomic_write(tmp_path / "missing" / "out.bin", lambda f: f.write(b"x"))
    assert info.value.filename == str(tmp_path / "missing" / "out.bin")


def test_other_errors_inside_the_block_keep_their_message(tmp_path: Path) -> None:
    def reset(f: object) -> None:
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    with pytest.raises(ConnectionResetError) as info:
        atomic_write(tmp_path / "w.pth", reset)
    assert info.value.filename is None


def test_inferred_classifier_size_is_bounded() -> None:
    from convnets.models.specs import MAX_CLASSES
    from convnets.weights.layouts import infer_spec

    model = convnets.get_model("resnet50", num_classes=2, **{k: v for k, v in TINY_SPEC.items() if k != "se_squeeze"})
    sd = dict(model.state_dict())
    sd["fc.weight"] = torch.zeros(1, 1).expand(MAX_CLASSES + 1, 256)  # no memory: a stride-0 view
    with pytest.raises(CheckpointError, match=str(MAX_CLASSES)):
        infer_spec(sd, source="f.pth")


# Sizes that the first hardening pass left unbounded --------------------------------------------------


@pytest.mark.parametrize("command, option", [("predict", "--batch-size"), ("embed", "--batch-size"),
                                             ("evaluate", "--batch-size"), ("export", "--max-batch-size")])
def test_batch_size_options_are_bounded_while_parsing(command: str, option: str) -> None:
    from convnets.cli import build_parser

    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if option in a.option_strings)
    assert action.type is not None
    assert action.type(str(MAX_BATCH_SIZE)) == MAX_BATCH_SIZE
    with pytest.raises(argparse.ArgumentTypeError, match=f"at most {MAX_BATCH_SIZE}"):
        action.type(str(MAX_BATCH_SIZE + 1))


def test_num_classes_is_bounded_before_the_head_is_allocated() -> None:
    import convnets

    with pytest.raises(InvalidArgumentError, match="num_classes must be an integer from 0 to"):
        convnets.resnet50(num_classes=10**12)


def test_a_fifo_image_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "photo.jpg"
    os.mkfifo(fifo)
    code = ("import sys\nfrom convnets.preprocessing.pipeline import load_image\n"
            "try:\n    load_image(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.startswith("ImageLoadError") and "not a regular file" in done.stdout, done.stdout + done.stderr
