"""Outputs that survive odd names, concurrent runs and odd files: real subprocesses, real files.

Covers ``--show`` refusing existing sheets, bytes-safe names (non-UTF-8, line breaks) in every
output format with ``--resume`` after a kill, the output locks of ``predict`` and ``train``, lock
files that are symbolic links, FIFO inputs, output directories that cannot be written, and a
``.jsonl`` whose last record lost its newline.
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, command_lines, heavy_imports, run_cli, start_cli
from PIL import Image

import convnets
from convnets.errors import InvalidArgumentError
from convnets.locking import LockHeldError, exclusive_lock
from convnets.inputs.listing import read_list
from convnets.inputs.names import decode_name, encode_name
from convnets.inference.outputs.npy import read_inputs_list
from convnets.inference.outputs.spool import spool_path

TINY_ARCH = {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}
COMMON = ["--image-size", "32", "--batch-size", "4", "--no-progress", "--workers", "0"]
BAD = b"img002\xff.png"  # not UTF-8: the file system's bytes, as os.fsdecode keeps them
N_GOOD = 12


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", **TINY_ARCH)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, path)
    return ["--weights", str(path)]


def _image(path: Path | bytes, seed: int) -> None:
    pixels = np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(buffer.getvalue())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Good images and one, also good, whose name is not UTF-8."""
    root = tmp_path_factory.mktemp("images")
    for i in range(N_GOOD):
        _image(root / f"img{i:03d}.png", i)
    _image(os.path.join(os.fsencode(root), BAD), 99)
    return root


def _names(folder: Path) -> list[str]:
    return sorted(str(folder / name) for name in os.listdir(folder))  # os.fsdecode names, as a listing gives


def _write_list(path: Path, names: list[str]) -> None:
    path.write_bytes(b"".join(os.fsencode(n) + b"\n" for n in names))


def _jsonl_inputs(path: Path) -> list[str]:
    return [json.loads(line)["input"] for line in path.read_bytes().splitlines()]


def _csv_inputs(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:  # valid UTF-8: names are escaped
        rows = list(csv.DictReader(f))
    return [decode_name(r["input"]) for r in rows if r["rank"] in ("1", "")]


def _kill_after_first_batch(command: list[str], watched: Path, lines: list[str], least: int) -> None:
    """Run ``python -m convnets COMMAND --from-file -`` with ``lines`` on a stdin left open, SIGKILL it
    once ``watched`` holds ``least`` bytes (or it died)."""
    proc = start_cli(*command, "--from-file", "-", stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(b"".join(os.fsencode(n) + b"\n" for n in lines))
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while (not watched.exists() or watched.stat().st_size < least) and proc.poll() is None:
        assert time.monotonic() < deadline, "no batch was written"
        time.sleep(0.01)
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate()
    assert alive, f"the run died before it was killed: {stderr.decode(errors='replace')[-2000:]}"


# --show ------------------------------------------------------------------------------------------


def test_show_refuses_existing_sheets_before_torch(folder: Path, tmp_path: Path, weights: list[str]) -> None:
    mine = {name: f"mine {name}".encode() for name in ("show.png", "show-2.png", "show-3.png")}
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    done = run_cli("predict", *weights, *COMMON, "--show", str(tmp_path / "show.png"), str(folder / "img000.png"),
                   fresh=True)
    imported = done.imported
    assert done.returncode == 2 and heavy_imports(imported) == []
    lines = command_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"convnets predict: error: --show {tmp_path / 'show.png'}"), lines
    assert all(str(tmp_path / name) in lines[0] for name in mine), lines  # names every existing sheet
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == mine  # nothing overwritten or deleted


# Bytes-safe names -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "npy"])
def test_non_utf8_name_is_a_good_record_and_resume_continues_past_it(fmt: str, weights: list[str], folder: Path,
                                                                      tmp_path: Path) -> None:
    names = _names(folder)
    bad = os.fsdecode(os.path.join(os.fsencode(folder), BAD))
    assert bad in names and names.index(bad) < 4  # in the first batch
    listing = tmp_path / "list.txt"
    _write_list(listing, names)
    command = "embed" if fmt == "npy" else "predict"
    out = tmp_path / f"run.{fmt}"
    watched = spool_path(out)  # every format: the spool grows while the run goes
    # Killed mid-run, after its first batch (which holds the name) is on disk ...
    _kill_after_first_batch([command, *weights, *COMMON, "--output", str(out)], watched, names, least=200)
    # ... and resumed with the same inputs from a list file (undecodable bytes in it too).
    done = run_cli(command, *weights, *COMMON, "--output", str(out), "--resume", "--from-file", str(listing))
    assert done.returncode == 0, done.stderr
    if fmt == "jsonl":
        recorded = _jsonl_inputs(out)
        out.read_bytes().decode("utf-8")  # a valid UTF-8 file
        assert b"\\udcff" in out.read_bytes()
    elif fmt == "csv":
        recorded = _csv_inputs(out)
    else:
        recorded = list(read_inputs_list(out))
        assert np.load(out).shape[0] == len(names)
    assert recorded == names  # each once, in order, the odd name a good record
    assert os.fsencode(recorded[names.index(bad)]) == os.path.join(os.fsencode(folder), BAD)  # the bytes, reversibly
    # The same from a directory listing, in one uninterrupted run.
    whole = tmp_path / f"whole.{fmt}"
    done = run_cli(command, *weights, *COMMON, "--output", str(whole), str(folder))
    assert done.returncode == 0, done.stderr
    if fmt == "jsonl":
        assert _jsonl_inputs(whole) == names
    elif fmt == "csv":
        assert _csv_inputs(whole) == names
    else:
        assert list(read_inputs_list(whole)) == names
        np.testing.assert_allclose(np.load(whole), np.load(out), rtol=1e-4, atol=1e-5)


def test_names_with_line_breaks_round_trip_through_npy_inputs_txt(weights: list[str], tmp_path: Path) -> None:
    images = tmp_path / "in"
    images.mkdir()
    odd = ["a\nb.png", "back\\slash.png", '"quoted.png', "plain.png", "tab\there.png"]
    for i, name in enumerate(odd):
        _image(images / name, i)
    out = tmp_path / "vecs.npy"
    done = run_cli("embed", *weights, *COMMON, "--output", str(out), str(images))
    assert done.returncode == 0, done.stderr
    expected = sorted(str(images / name) for name in odd)
    assert list(read_inputs_list(out)) == expected
    lines = (tmp_path / "vecs.npy.inputs.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == np.load(out).shape[0] == len(odd)  # one line per row, whatever the names hold
    assert lines[expected.index(str(images / "plain.png"))] == str(images / "plain.png")  # plain names stay plain
    for name in [*odd, os.fsdecode(BAD), "x\u2028y"]:
        assert decode_name(encode_name(name)) == name and "\n" not in encode_name(name)


def test_from_file_read_errors_name_the_list_and_line() -> None:
    class Failing:
        def __iter__(self):
            yield "a.png\n"
            yield "# comment\n"
            raise OSError(errno.EIO, "Input/output error")

    lines = read_list(Failing(), "list.txt")  # type: ignore[arg-type]
    assert next(lines) == "a.png"
    with pytest.raises(InvalidArgumentError, match=r"--from-file list.txt, line 3: cannot read it \(Input/output"):
        next(lines)


# Locks ------------------------------------------------------------------------------------------


def test_two_predict_runs_on_one_output_the_second_fails_at_once(weights: list[str], tmp_path: Path) -> None:
    images = tmp_path / "in"
    images.mkdir()
    for i in range(200):
        _image(images / f"{i:03d}.png", i)
    names = _names(images)
    listing = tmp_path / "list.txt"
    _write_list(listing, names)
    out = tmp_path / "r.jsonl"
    lock = tmp_path / "r.jsonl.lock"
    first = start_cli("predict", *weights, *COMMON, "--output", str(out), "--resume", "--from-file", "-",
                      stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert first.stdin is not None
        first.stdin.write(b"".join(os.fsencode(n) + b"\n" for n in names[:100]))
        first.stdin.flush()  # stdin stays open: the first run cannot end before the second has tried
        deadline = time.monotonic() + 120
        while not (spool_path(out).exists() and spool_path(out).stat().st_size > 0):
            assert first.poll() is None and time.monotonic() < deadline, "the first run wrote nothing"
            time.sleep(0.02)
        assert lock.exists()
        # Refused while the command line is checked: before PyTorch (the interpreter's import report).
        second = run_cli("predict", *weights, *COMMON, "--output", str(out), "--resume", "--from-file", str(listing),
                         fresh=True)
        imported = second.imported
        assert first.poll() is None
        assert second.returncode == 1 and heavy_imports(imported) == []
        lines = command_lines(second.stderr)
        assert len(lines) == 1 and f"--output {out} is being written by another run (PID {first.pid} on host" in lines[0]
        first.stdin.write(b"".join(os.fsencode(n) + b"\n" for n in names[100:]))
        first.stdin.close()
        assert first.wait(180) == 0, first.stderr.read() if first.stderr else ""
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert _jsonl_inputs(out) == names  # exactly 200 records, each once
    assert not lock.exists()  # removed by its holder at the end


def test_embed_on_a_held_output_is_refused_before_torch(weights: list[str], folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "v.npy"
    with exclusive_lock(tmp_path / "v.npy.lock", timeout=0):  # as a running embed holds it
        done = run_cli("embed", *weights, *COMMON, "--output", str(out), str(folder), fresh=True)
        imported = done.imported
    lines = command_lines(done.stderr)
    assert done.returncode == 1 and heavy_imports(imported) == [], lines
    assert len(lines) == 1 and lines[0].startswith(f"convnets embed: error: --output {out} is being written by "
                                                   f"another run (PID {os.getpid()} on host "), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the holder's lock file went with it; nothing else


def test_two_train_runs_on_one_output_directory_the_second_fails_at_once(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from train_support import cli_env, make_digits, tiny_args, train_cmd

    data = make_digits(tmp_path / "digits", n_train=64, n_val=32)
    out = tmp_path / "run"
    args = tiny_args(data, out, 200)
    first = subprocess.Popen(train_cmd(*args), cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out / ".lock").exists() or not (out / ".lock").read_text().strip():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.02)
        start = time.monotonic()
        second = subprocess.run(train_cmd(*args), cwd=REPO, env=cli_env(), capture_output=True, text=True,
                                timeout=120)
        assert time.monotonic() - start < 60 and first.poll() is None
        assert second.returncode != 0
        assert f"--output {out} is being written by another run (PID {first.pid} on host" in second.stderr, \
            second.stderr
    finally:
        first.kill()
        first.wait()


def test_a_symlinked_lock_file_is_never_followed(tmp_path: Path, weights: list[str], folder: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "w.pth.lock"
    link.symlink_to(victim)
    with pytest.raises(OSError) as caught, exclusive_lock(link, timeout=0):
        pass
    assert caught.value.errno == errno.ELOOP and "symbolic link" in str(caught.value)
    assert victim.read_text() == "precious" and link.is_symlink()
    dangling = tmp_path / "x.lock"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(OSError), exclusive_lock(dangling, timeout=0):
        pass
    assert not (tmp_path / "created-through-the-link").exists()
    # On the command line: one error line, before PyTorch.
    (tmp_path / "r.jsonl.lock").symlink_to(victim)
    done = run_cli("predict", *weights, *COMMON, "--output", str(tmp_path / "r.jsonl"), str(folder / "img000.png"),
                   fresh=True)
    imported = done.imported
    lines = command_lines(done.stderr)
    assert done.returncode != 0 and len(lines) == 1 and "symbolic link" in lines[0], lines
    assert heavy_imports(imported) == []
    assert victim.read_text() == "precious"


def test_lock_held_error_names_the_holder(tmp_path: Path) -> None:
    lock = tmp_path / "out.lock"
    with exclusive_lock(lock, timeout=0):
        assert lock.read_text().split()[0] == str(os.getpid())
        with pytest.raises(LockHeldError) as caught, exclusive_lock(lock, timeout=0):
            pass
        assert caught.value.holder.startswith(f"PID {os.getpid()} on host ")
    assert not lock.exists()


# Odd inputs and destinations --------------------------------------------------------------------


def test_fifo_input_is_refused_without_blocking(weights: list[str], folder: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    done = run_cli("predict", *weights, *COMMON, "--json", str(fifo), str(folder / "img000.png"), timeout=120)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "FIFO" in errors[0] and str(fifo) in errors[0], done.stderr
    assert [r["input"] for r in json.loads(done.stdout)] == [str(folder / "img000.png")]


@pytest.mark.parametrize("command", ["predict", "embed"])
def test_output_in_a_missing_or_read_only_directory_fails_before_torch(command: str, folder: Path, tmp_path: Path,
                                                                       weights: list[str]) -> None:
    missing = tmp_path / "no" / "such"
    suffix = "npy" if command == "embed" else "jsonl"
    read_only = Path("/sys") if os.geteuid() == 0 else tmp_path / "ro"  # root writes in any mode-0555 directory
    if read_only != Path("/sys"):
        read_only.mkdir()
        read_only.chmod(0o555)
    for directory, problem in ((missing, "does not exist"), (read_only, "cannot write in")):
        target = directory / f"out.{suffix}"
        done = run_cli(command, *weights, *COMMON, "--output", str(target), str(folder / "img000.png"), fresh=True)
        imported = done.imported
        lines = command_lines(done.stderr)
        assert done.returncode == 2 and len(lines) == 1 and heavy_imports(imported) == [], lines
        assert lines[0].startswith(f"convnets {command}: error: --output {target}: ") and problem in lines[0], lines


def test_resume_keeps_a_last_record_that_only_lacks_its_newline(weights: list[str], folder: Path,
                                                                 tmp_path: Path) -> None:
    names = _names(folder)
    out = tmp_path / "r.jsonl"
    done = run_cli("predict", *weights, *COMMON, "--output", str(out), *names[:6])
    assert done.returncode == 0, done.stderr
    lines = out.read_bytes().splitlines()
    last = json.loads(lines[-1])
    last["top"][0]["probability"] = 0.5  # a mark: a record redone would not have it
    out.write_bytes(b"\n".join([*lines[:-1], json.dumps(last, ensure_ascii=False).encode()]))  # no final newline
    done = run_cli("predict", *weights, *COMMON, "--output", str(out), "--resume", *names)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["input"] for r in records] == names and records[5] == last
    assert out.read_bytes().endswith(b"\n")


def _odd_exif_jpeg(path: Path, tags: int) -> None:
    """A good JPEG whose EXIF block lists ``tags`` entries whose data lie past its end: Pillow warns per tag."""
    import struct

    entries = b"".join(struct.pack("<HHII", 0x9000 + i, 2, 100, 8) for i in range(tags))
    exif = b"Exif\x00\x00II*\x00" + struct.pack("<IH", 8, tags) + entries + struct.pack("<I", 0)
    Image.new("RGB", (64, 48), (100, 50, 20)).save(path, "JPEG", exif=exif)


def _pillow_warnings(path: Path) -> list[str]:
    """What Pillow warns when it reads ``path``'s EXIF, as the decoder does, each warning kept."""
    import warnings

    with warnings.catch_warnings(record=True) as caught, Image.open(path) as image:
        warnings.simplefilter("always")
        image.getexif()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_pillows_warnings_are_counted_into_one_line(workers: str, weights: list[str], folder: Path,
                                                    tmp_path: Path) -> None:
    odd = [tmp_path / "odd1.jpg", tmp_path / "odd2.jpg"]
    _odd_exif_jpeg(odd[0], 3000)
    _odd_exif_jpeg(odd[1], 1000)
    expected = [_pillow_warnings(path) for path in odd]
    assert len(expected[0]) > 2000 and len(expected[1]) > 500  # what flooded stderr, two lines each
    inputs = [str(odd[0]), str(folder / "img000.png"), str(odd[1])]
    out = tmp_path / "r.jsonl"
    done = run_cli("predict", *weights, *COMMON[:-1], workers, "--output", str(out), *inputs)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["input"] for line in out.read_text().splitlines()] == inputs  # all classified
    lines = command_lines(done.stderr)
    assert len(lines) == 1, done.stderr[-2000:]
    total = len(expected[0]) + len(expected[1])
    # "first" is the first in time: the two odd images may be decoded concurrently, so either one's first warning
    assert lines[0] in {f"convnets predict: Pillow warned {total} time(s) about odd image data (first: "
                        f"{warned[0]}); -vv shows each" for warned in expected}, lines
