"""Sizes from files and the command line are bounded before anything is allocated.

A checkpoint cannot run code, but a mistaken or hostile one could still record sizes that exhaust
memory (an image size of 100000, an ``arch_spec`` of 300000 blocks, a nested or million-entry
list); so could a typo on the command line. Each must end in one error line that names the file
and its entry (or the option) and the limit, never in a traceback, a ``MemoryError`` or 24 GB of RSS.
The command-line cases run in real subprocesses with 2 GB of address space beyond what the process maps at start.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import forked_cli
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
#: Address space each command may map beyond what its process maps at start (PyTorch with its CUDA libraries: 3.26 GB
#: on the machines here): a run fits, 24 GB of RSS or the 20 GB resize of a thin image does not. Relative, because an
#: absolute 4 GB left some machines too little for a few decoding threads ("can't start new thread").
MEMORY_HEADROOM = 2 << 30
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


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CONVNETS_DEBUG", None)
    return forked_cli.run(list(args), env=env, cwd=cwd, timeout=120, extra_as=MEMORY_HEADROOM)


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
    code = ("import sys\nfrom convnets.preprocessing.decode import load_image\n"
            "try:\n    load_image(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    done = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.startswith("ImageLoadError") and "not a regular file" in done.stdout, done.stdout + done.stderr


# One bad input is one bad record, whatever its shape ---------------------------------------------------


def _thin_png(path: Path, size: tuple[int, int] = (1, 100000)) -> Path:
    """A valid PNG of one colour: a few hundred bytes, whose resize to 256 would take 20 GB."""
    from PIL import Image

    Image.new("RGB", size, (10, 20, 30)).save(path, optimize=True)
    return path


@pytest.fixture(scope="module")
def tiny_weights(state: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.pth"
    torch.save({"state_dict": state, "arch_spec": TINY_SPEC}, path)
    return path


def _photos(folder: Path, count: int) -> list[Path]:
    import numpy as np
    from PIL import Image

    paths = []
    for i in range(count):
        pixels = np.random.default_rng(i).integers(0, 255, (40, 50, 3), dtype=np.uint8)
        paths.append(folder / f"photo{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def test_a_thin_image_is_refused_before_it_is_decoded_or_resized(tmp_path: Path) -> None:
    from convnets.errors import ImageDecodeError
    from convnets.preprocessing.decode import check_resize
    from convnets.preprocessing.pipeline import prepare_batch

    # The audit's image, by arithmetic only: decoding it here would take 20 GB in this process.
    with pytest.raises(ImageDecodeError, match=r"'thin.png': image 1x100000 is too thin: .* 256x25600000 ") as info:
        check_resize(1, 100000, 256, "'thin.png'")
    assert info.value.message_for("cli").endswith("more than the limit of 89478485.")  # no Python advice
    check_resize(30000, 2000, 256, "'panorama.png'")  # 3840x256: well inside the limit
    # The same rule with a small limit, on files: the input passes the bomb check, its resize does not.
    limit = 300_000
    strip, flat = _thin_png(tmp_path / "strip.png", (10, 2000)), _thin_png(tmp_path / "flat.png", (2000, 10))
    panorama = _thin_png(tmp_path / "panorama.png", (300, 200))
    batch = prepare_batch([str(IMAGE), str(strip), str(flat), str(panorama)], on_error="collect", max_pixels=limit)
    assert batch.indices == [0, 3] and [i for i, _ in batch.errors] == [1, 2]  # the photo: 640x427, resized 383x256
    for (_, error), path, size in zip(batch.errors, (strip, flat), ("10x2000", "2000x10")):
        assert isinstance(error, ImageDecodeError) and str(path) in str(error) and f"{size} is too thin" in str(error)
        assert f"more than the limit of {limit}" in str(error)


@pytest.mark.parametrize("command, suffix", [("predict", "jsonl"), ("embed", "npy")])
def test_a_thin_image_among_photos_is_one_bad_record(command: str, suffix: str, tiny_weights: Path,
                                                      tmp_path: Path) -> None:
    """The audit's case: a 467-byte 1x100000 PNG in a batch of photos, with 2 GB of address space beyond what the process maps at start
    (resizing it to 256 would take 20 GB: before, the whole batch ended in "out of memory")."""
    photos = _photos(tmp_path, 3)
    thin = _thin_png(tmp_path / "thin.png")
    inputs = [str(photos[0]), str(thin), str(photos[1]), str(photos[2])]
    out = tmp_path / f"out.{suffix}"
    result = _cli(command, "--weights", str(tiny_weights), "--batch-size", "8", "--workers", "0", "--no-progress",
                  "--output", str(out), *inputs)
    line = _one_error_line(result)
    assert str(thin) in line and "1x100000 is too thin" in line, line
    if command == "predict":
        records = [json.loads(text) for text in out.read_text().splitlines()]
        assert [r["input"] for r in records] == inputs
        assert [("error" in r) for r in records] == [False, True, False, False]
        assert "1x100000 is too thin" in records[1]["error"] and all(len(r["top"]) == 5 for r in records[::2])
    else:
        import numpy as np

        assert np.load(out).shape[0] == 3
        assert (tmp_path / "out.npy.inputs.txt").read_text().splitlines() == [str(p) for p in photos]


def test_any_failure_of_one_input_is_that_inputs_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A MemoryError (or anything else) while decoding or preprocessing one image fails that image only."""
    import convnets.preprocessing.decode as decode
    import convnets.preprocessing.pipeline as pipeline
    from convnets.errors import ImageDecodeError

    from PIL import Image

    photos = _photos(tmp_path, 3)
    big, odd = tmp_path / "big.png", tmp_path / "odd.png"
    Image.new("RGB", (61, 47)).save(big)  # its resize runs out of memory
    Image.new("RGB", (53, 41)).save(odd)  # its decoder has a bug
    preprocess, to_rgb = pipeline.preprocess_image, decode.to_rgb  # the batch's transform, the decoder's conversion

    def preprocess_failing(image: Image.Image, **kwargs: object) -> torch.Tensor:
        if image.size == (61, 47):
            raise MemoryError()
        return preprocess(image, **kwargs)  # type: ignore[arg-type]

    def to_rgb_failing(image: Image.Image) -> Image.Image:
        if image.size == (53, 41):
            raise KeyError("a decoder's bug")
        return to_rgb(image)
    monkeypatch.setattr(pipeline, "preprocess_image", preprocess_failing)
    monkeypatch.setattr(decode, "to_rgb", to_rgb_failing)
    inputs = [str(photos[0]), str(big), str(photos[1]), str(odd), str(photos[2])]
    for workers in (1, 3):
        batch = pipeline.prepare_batch(inputs, on_error="collect", workers=workers)
        assert batch.indices == [0, 2, 4]
        (i, memory), (j, other) = batch.errors
        assert (i, j) == (1, 3) and isinstance(memory, ImageDecodeError) and isinstance(other, ImageDecodeError)
        assert str(big) in str(memory) and "ran out of memory" in str(memory) and "MemoryError" in str(memory)
        assert str(odd) in str(other) and "KeyError" in str(other)
    # On the command line (in this process, decoding here): a record per input, the run goes on.
    out = tmp_path / "r.jsonl"
    monkeypatch.delenv("CONVNETS_DEBUG", raising=False)
    assert main(["predict", "--random-init", "--model", "resnet50", "--arch-kwargs", json.dumps(
        {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}), "--image-size", "32", "--workers", "0",
                 "--no-progress", "--output", str(out), *inputs]) == 1
    records = [json.loads(text) for text in out.read_text().splitlines()]
    assert [r["input"] for r in records] == inputs
    assert ["error" in r for r in records] == [False, True, False, True, False]
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 2 and errors[0].startswith(f"convnets predict: error: Cannot load image '{big}'")
    assert "ran out of memory" in errors[0]


# Resuming reads what it finds in bounded memory -----------------------------------------------------------


def _no_newlines(path: Path, size: int = 50_000_000) -> Path:
    with open(path, "wb") as f:
        for _ in range(size // 1_000_000):
            f.write(b"x" * 1_000_000)
    return path


# Before the spool, --resume scanned the .jsonl or .csv output itself; now it scans the spool, and reads a
# finished .jsonl or .csv back into one: both in bounded memory.
@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_resume_scans_a_file_without_newlines_in_bounded_memory(suffix: str, tmp_path: Path) -> None:
    import tracemalloc

    from convnets.inference.outputs import Output
    from convnets.inference.outputs.spool import MAX_RECORD_BYTES, scan

    path = _no_newlines(tmp_path / f"out.{suffix}")
    tracemalloc.start()
    try:
        with pytest.raises(InvalidArgumentError) as info:
            if suffix == "jsonl":
                scan(path, width=5)  # a spool (a .jsonl file of predictions is read the same way)
            else:
                list(Output.of(path, "predictions").format.read(path, "predictions"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_RECORD_BYTES < 50_000_000, peak  # about one record, not the file
    cli = info.value.message_for("cli")
    assert str(path) in cli and "--resume" in cli and f"more than {MAX_RECORD_BYTES} bytes" in cli, cli
    assert path.stat().st_size == 50_000_000  # refused, not cut away as a torn tail


# Before, the binary spool's frame header could claim gigabytes; a JSON line cannot claim anything, so the
# same guarantee is pinned on a line longer than any embedding record: refused, neither read whole nor cut.
def test_resume_refuses_a_spool_line_longer_than_any_record(tmp_path: Path) -> None:
    import numpy as np

    from convnets.inference.outputs.spool import scan, write_spool

    spool = tmp_path / "v.npy.partial.jsonl"
    write_spool(spool, [{"input": "a.png", "embedding": np.ones(4, dtype=np.float32)}])
    with open(spool, "ab") as f:
        f.write(b'{"input": "b.png", "embedding": "' + b"A" * 40_000_000 + b'"}\n')
    size = spool.stat().st_size
    with pytest.raises(InvalidArgumentError, match="longer than any record convnets writes") as info:
        scan(spool, kind="embeddings")
    assert str(spool) in str(info.value) and "--resume" in info.value.message_for("cli")
    assert spool.stat().st_size == size  # not cut as a torn line


@pytest.mark.parametrize("kind", ["a link to /dev/zero", "a link to nothing", "a FIFO", "50 MB without a newline"])
@pytest.mark.parametrize("command", ["predict", "embed"])
def test_resume_of_an_output_that_no_run_left_is_one_clear_error(command: str, kind: str, tiny_weights: Path,
                                                                   tmp_path: Path) -> None:
    """Before, a link to /dev/zero grew the process until the kernel killed it (under this address-space limit: "out of
    memory ... --batch-size"), a FIFO blocked, a line without end was cut away as a torn record, and a dangling
    link to a spool ended in a raw FileExistsError."""
    out = tmp_path / ("out.jsonl" if command == "predict" else "out.npy")
    # What --resume reads: a finished .jsonl (predict), a spool (embed: an .npy cannot be read back).
    odd = out if command == "predict" else out.with_name(out.name + ".partial.jsonl")
    if kind == "a link to /dev/zero":
        odd.symlink_to("/dev/zero")
    elif kind == "a link to nothing":
        odd.symlink_to(tmp_path / "gone")
    elif kind == "a FIFO":
        os.mkfifo(odd)
    else:
        _no_newlines(odd)
    line = _one_error_line(_cli(command, "--weights", str(tiny_weights), "--workers", "0", "--no-progress",
                                "--resume", "--output", str(out), str(IMAGE)))
    assert str(odd) in line and "--resume" in line and "--batch-size" not in line, line
    if kind == "50 MB without a newline":
        assert odd.stat().st_size == 50_000_000


# A full disk: the message names the file ---------------------------------------------------------------


def _no_space(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


class _FullFile(io.RawIOBase):
    """A writable file on a full disk: every write fails as the kernel's would (naming no file)."""

    name = "/somewhere/out.jsonl"

    def writable(self) -> bool:
        return True

    def write(self, data: object) -> int:
        _no_space()
        return 0


# Before, the record writer (JSONL, CSV header) and the embedding spool writer were tested apart; now one
# spool writer takes both kinds of record (the final files are written by atomic_output, which names its file).
def test_spool_writes_name_their_file_when_the_disk_is_full(tmp_path: Path) -> None:
    from convnets.inference.outputs.spool import SpoolWriter

    for record in ({"input": "a.png", "error": "x"}, {"input": "a.png", "embedding": [1.0, 2.0]}):
        writer = SpoolWriter(io.TextIOWrapper(io.BufferedWriter(_FullFile()), encoding="utf-8"))
        writer.write(record)
        with pytest.raises(OSError) as info:
            writer.flush()
        assert info.value.errno == errno.ENOSPC and info.value.filename == "/somewhere/out.jsonl"


def test_an_error_on_its_way_is_not_replaced_by_closing_the_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full disk, closing the temporary file flushes the same bytes again and fails again, unnamed."""
    import convnets.fileio

    closed = []

    class Full(io.BufferedWriter):
        def close(self) -> None:
            closed.append(self.raw.name)
            super().close()
            _no_space()

    def half(f: io.BufferedWriter) -> None:
        f.write(b"x" * 100)
        _no_space()
    monkeypatch.setattr(convnets.fileio, "open", lambda path, mode, **kw: Full(io.FileIO(path, "x", **kw)), raising=False)
    with pytest.raises(OSError) as info:
        atomic_write(tmp_path / "out.npy", half)
    assert len(closed) == 1 and info.value.filename == str(tmp_path / "out.npy")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("cold_engine_cache")  # its own cache, to see that nothing is left in it
def test_export_and_engine_cache_fills_name_their_destination_when_the_disk_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO's save_model raises RuntimeError('basic_ios::clear: iostream error') on a full disk: no errno."""
    from collections import namedtuple

    from convnets.deploy import cache
    from convnets.deploy.export import export_model
    from convnets.deploy.formats import get_format
    from convnets.errors import ExportError

    def lost_errno(*args: object, **kwargs: object) -> None:
        raise RuntimeError("basic_ios::clear: iostream error")
    statvfs = namedtuple("statvfs", "f_bavail f_frsize")
    model = convnets.get_model("resnet50", **{k: v for k, v in TINY_SPEC.items() if k != "se_squeeze"}).eval()
    fmt = get_format("onnx")
    monkeypatch.setattr(type(fmt), "write", lost_errno)
    with pytest.raises(ExportError) as info:  # a disk with room: the error as it is
        export_model(model, tmp_path / "m.onnx", batch=torch.zeros(2, 3, 32, 32), image_size=32)
    assert "no space" not in str(info.value)
    monkeypatch.setattr(os, "statvfs", lambda path: statvfs(0, 4096), raising=False)
    with pytest.raises(ExportError) as info:
        export_model(model, tmp_path / "m.onnx", batch=torch.zeros(2, 3, 32, 32), image_size=32)
    assert f"writing {tmp_path / 'm.onnx'}: no space left" in str(info.value) and "RuntimeError" in str(info.value)
    with pytest.raises(OSError) as caught:
        cache.cached_runner(model, engine="openvino", precision="fp32", shape=(3, 32, 32), runtimes=(),
                            files=("model.xml",), write=lost_errno, load=lost_errno)  # type: ignore[arg-type]
    assert caught.value.errno == errno.ENOSPC and str(cache.cache_root()) in str(caught.value.filename)
    assert "CONVNETS_CACHE_DIR" in str(caught.value)
    assert [p for p in cache.cache_root().rglob("*") if p.is_file()] == []  # no half entry left


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """A 64 KiB tmpfs, filled up to ``pages`` free 4 KiB pages: a real full disk. Mounting needs root."""
    mounted: list[Path] = []

    def make(pages: int) -> Path:
        where = tmp_path / f"full{len(mounted)}"
        where.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                               capture_output=True).returncode != 0:
            pytest.skip("mounting a small tmpfs needs root and a system that allows it")
        mounted.append(where)
        fd = os.open(where / ".filler", os.O_WRONLY | os.O_CREAT)
        written = 0
        try:
            while True:
                written += os.write(fd, b"x" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        os.ftruncate(fd, max(written - pages * 4096, 0))
        os.close(fd)
        return where
    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("case", ["predict", "embed", "export onnx", "export openvino", "engine cache fill"])
def test_a_full_disk_is_one_line_naming_the_file(case: str, tiny_weights: Path,
                                                 tiny_tmpfs: Callable[[int], Path], tmp_path: Path) -> None:
    from conftest import run_cli

    photos = [str(p) for p in _photos(tmp_path, 6)]
    full = tiny_tmpfs(2 if case == "embed" else 1)  # a page for the output's lock (and one for the spool)
    common = ["--weights", str(tiny_weights), "--workers", "0", "--no-progress", "--batch-size", "2"]
    env = {}
    if case == "predict":
        args, named = ["predict", *common, "--engine", "torch", "--output", str(full / "out.jsonl"), *photos], \
            full / "out.jsonl.partial.jsonl"  # the spool fills the disk before out.jsonl is written
    elif case == "embed":
        args, named = ["embed", *common, "--engine", "torch", "--output", str(full / "v.npy"), *photos], \
            full / "v.npy.partial.jsonl"
    elif case.startswith("export"):
        fmt = case.split()[1]
        args = ["export", "--weights", str(tiny_weights), "--format", fmt, "--output", str(full)]
        named = full / ("model.onnx" if fmt == "onnx" else "model.xml")
    else:
        args, named = ["predict", *common, "--engine", "openvino", photos[0]], full / "engines" / "openvino-"
        env = {"CONVNETS_CACHE_DIR": str(full / "engines")}
    done = run_cli(*args, env=env, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(named) in errors[0], done.stderr[-3000:]
    assert "No space left on device" in errors[0] or "no space left" in errors[0], errors[0]
