"""``convnets predict`` at scale: the spool that grows while a run goes, resume after a kill, inputs that stream.

Every run is a real subprocess of a tiny random-init ResNet on many small generated images, so
that several batches are written and a SIGKILL can land between (or inside) them.
"""

from __future__ import annotations

import csv
import json
import random
import re
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_in_process, kill_midway, run_cli
from PIL import Image
from strict_skips import require_module

import convnets
from convnets.inference.outputs import Output
from convnets.inference.outputs.csv import COLUMNS as CSV_COLUMNS
from convnets.inference.outputs.spool import scan, spool_path, write_spool

TINY_ARCH = {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}
# Random init for runs that compare nothing; runs whose records are compared share one checkpoint.
RANDOM = ["--random-init", "--model", "resnet50", "--arch-kwargs", json.dumps(TINY_ARCH),
          "--image-size", "32", "--batch-size", "4", "--topk", "3", "--no-progress"]
MODEL = [*RANDOM]  # --weights CHECKPOINT instead of --random-init (see the checkpoint fixture)
N_IMAGES = 120


@pytest.fixture(scope="module", autouse=True)
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model saved once, so that every run of this module computes the same numbers."""
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", **TINY_ARCH)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, path)
    MODEL[:5] = ["--weights", str(path)]
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tree of tiny images, with corrupt, truncated, non-image and hidden files among them."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(N_IMAGES):
        folder = root / f"part{i % 3}" / ("deep" if i % 5 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(folder / f"img{i:04d}.png")
    good = (root / "part0" / "img0003.png").read_bytes()
    (root / "part1" / "truncated.png").write_bytes(good[: len(good) // 2])
    (root / "part1" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff" + bytes(200))
    (root / "part2" / "notes.jpg").write_text("not an image")
    (root / "part2" / "readme.txt").write_text("not listed: no image suffix")
    (root / "part0" / ".hidden.png").write_bytes(good)
    (root / "part0" / "._img0003.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (root / ".cache").mkdir()
    (root / ".cache" / "img9999.png").write_bytes(good)
    return root


def _predict(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_cli("predict", *MODEL, *args, timeout=timeout)


@pytest.fixture(scope="module")
def reference(images: Path) -> dict:
    """An uninterrupted run: its --json array and error lines, and the --jsonl stream of another run."""
    done = _predict("--json", "--recursive", str(images))
    assert done.returncode == 1, done.stderr  # the bad files fail, the rest is predicted
    streamed = _predict("--jsonl", "--recursive", str(images))
    assert streamed.returncode == 1, streamed.stderr
    return {"json": json.loads(done.stdout), "errors": _error_lines(done.stderr),
            "jsonl": [json.loads(line) for line in streamed.stdout.splitlines()], "stderr": streamed.stderr}


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("convnets predict: error:")]


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _same_records(got: list[dict], expected: list[dict]) -> bool:
    """Same inputs, errors and classes in the same order; probabilities equal up to float rounding
    (an image computed in a batch of other size than in the reference run may differ in the last bits)."""
    def strip(records: list[dict]) -> list[dict]:
        return [{**r, "top": [{**t, "probability": None} for t in r["top"]]} if "top" in r else r for r in records]
    assert strip(got) == strip(expected)
    probabilities = [[t["probability"] for t in r.get("top", [])] for r in got]
    np.testing.assert_allclose(sum(probabilities, []), sum([[t["probability"] for t in r.get("top", [])]
                                                            for r in expected], []), rtol=1e-5)
    return True


def _read_csv(path: Path) -> list[dict]:
    """CSV rows grouped back into records, with the standard csv module."""
    records: list[dict] = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        for row in reader:
            if row["error"]:
                assert row["rank"] == "" and row["index"] == ""
                records.append({"input": row["input"], "error": row["error"]})
                continue
            if row["rank"] == "1":
                records.append({"input": row["input"], "top": []})
            assert records[-1]["input"] == row["input"] and int(row["rank"]) == len(records[-1]["top"]) + 1
            records[-1]["top"].append({"index": int(row["index"]), "label": row["label"],
                                       "probability": float(row["probability"])})
    return records


def test_inputs_tree_order_and_hidden_files(reference: dict, images: Path) -> None:
    inputs = [r["input"] for r in reference["jsonl"]]
    assert len(inputs) == len(set(inputs)) == N_IMAGES + 3  # 3 unreadable; hidden and .txt files not listed
    assert not any("/." in name for name in inputs)
    # Depth first, sorted by path components: part0/deep/... before part0/img..., part0 before part1.
    parts = [Path(name).relative_to(images).parts for name in inputs]
    assert parts == sorted(parts)
    assert parts[0][:2] == ("part0", "deep")


def test_jsonl_matches_json_and_errors_match_stderr(reference: dict) -> None:
    ok = [r for r in reference["jsonl"] if "top" in r]
    failed = [r for r in reference["jsonl"] if "error" in r]
    assert ok == reference["json"]  # same records, same order, same numbers as the --json array
    assert sorted(Path(r["input"]).name for r in failed) == ["corrupt.jpg", "notes.jpg", "truncated.png"]
    assert [f"convnets predict: error: {r['error']}" for r in failed] == reference["errors"]
    assert _error_lines(reference["stderr"]) == reference["errors"]  # stderr unchanged with --jsonl


def test_csv_and_parquet_read_back_with_standard_readers(reference: dict, images: Path, tmp_path: Path) -> None:
    pq = require_module("pyarrow.parquet")
    out_csv, out_parquet = tmp_path / "all.csv", tmp_path / "all.parquet"
    for out in (out_csv, out_parquet):
        done = _predict("--recursive", str(images), "--output", str(out))
        assert done.returncode == 1 and "Traceback" not in done.stderr
    assert _read_csv(out_csv) == reference["jsonl"]
    table = pq.read_table(out_parquet)
    assert table.column_names == ["input", "top", "error"]
    rows = [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    assert rows == reference["jsonl"]
    assert pq.ParquetFile(out_parquet).num_row_groups == -(-len(rows) // 4)  # a row group per batch


def test_from_file_list_with_comments_and_stdin(reference: dict, images: Path) -> None:
    """INPUTs first, then the list ('-': standard input): comments and blank lines skipped, a folder expanded."""
    names = [r["input"] for r in reference["jsonl"]]
    deep = images / "part0" / "deep"
    listing = f"# a comment\n\n{names[3]}\n  {names[4]}  \n{deep}\n"
    proc = run_cli("predict", *MODEL, "--jsonl", *names[:3], "--from-file", "-", input=listing.encode(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    by_name = {r["input"]: r for r in reference["jsonl"]}
    expected = [by_name[n] for n in names[:5]] + [r for r in reference["jsonl"] if Path(r["input"]).parent == deep]
    assert _same_records([json.loads(line) for line in proc.stdout.splitlines()], expected)


@pytest.mark.parametrize("args, message, status", [
    (["--output", "out.txt"], "--output out.txt: unknown format '.txt'", 2),  # a usage error
    (["--resume", "--jsonl"], "--resume continues an --output FILE", 1),
    (["--output", "left.parquet"], "left.parquet.partial.jsonl exists: a stopped run left it; pass --resume", 1),
    (["--output", "exists.jsonl"], "--output exists.jsonl exists; pass --resume", 1),
])
def test_bad_output_options_end_in_one_line(args: list[str], message: str, status: int, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from convnets.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "exists.jsonl").write_text("keep me\n")
    (tmp_path / "left.parquet.partial.jsonl").write_text("keep me\n")  # a killed run's spool
    (tmp_path / "x.png").write_bytes(b"")  # an INPUT that exists: refused before it is read
    assert main(["predict", *RANDOM, *args, "x.png"]) == status
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1  # before the model loads: not even its warning
    assert (tmp_path / "exists.jsonl").read_text() == (tmp_path / "left.parquet.partial.jsonl").read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.jsonl", "left.parquet.partial.jsonl", "x.png"]


def _write_records(path: Path, records: list[dict]) -> None:
    """What an earlier run wrote to its spool (the lines of a JSONL file), written by the same code in this process."""
    write_spool(path, records)


def _read_back(path: Path) -> list[dict]:
    """The records of a finished output, read with the standard readers (json, csv, pyarrow)."""
    if path.suffix == ".parquet":
        table = require_module("pyarrow.parquet").read_table(path)
        return [{k: v for k, v in row.items() if v is not None} for row in table.to_pylist()]
    return _read_jsonl(path) if path.suffix == ".jsonl" else _read_csv(path)


# Before the spool, a killed run left a torn .jsonl or .csv; now it leaves the spool whatever the format,
# and FILE appears at the end: the kill lands in the spool, and the resumed run writes FILE.
@pytest.mark.parametrize("fmt, seed", [("jsonl", 1), ("csv", 2), ("jsonl", 3), ("parquet", 4)])
def test_sigkill_then_resume_gives_the_uninterrupted_records(fmt: str, seed: int, reference: dict, images: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / f"run.{fmt}"
    spool = spool_path(out)
    # The inputs in the order of the reference run (--recursive over the same tree), as a list.
    inputs = [r["input"] for r in reference["jsonl"]]
    listing = tmp_path / "inputs.txt"
    listing.write_text("".join(f"{name}\n" for name in inputs), encoding="utf-8")
    args = ["--output", str(out)]
    # The size of the whole file, from the reference records: the kill lands between 10% and 80% of it
    # (after at least one batch), at a random moment (a batch's write may be in flight).
    _write_records(tmp_path / "full.jsonl", reference["jsonl"])
    full_size = (tmp_path / "full.jsonl").stat().st_size
    rng = random.Random(seed)
    # --workers 1: the main process reads the inputs PREFETCH * workers + 1 batches ahead of the records
    # written, and those ahead wait on the open stdin; the default (up to 4 workers) would hold back
    # more than the kill threshold on a machine with many cores.
    kill_midway(["predict", *MODEL, *args, "--workers", "1"], spool, inputs[:-4],
                after_bytes=int(rng.uniform(0.1, 0.8) * full_size), extra_s=rng.uniform(0, 0.02), deadline_s=90)
    killed_size = spool.stat().st_size
    assert not out.exists()  # a killed run leaves the spool, not a half-written FILE
    assert 0 < scan(spool, width=3, repair=False).records < len(reference["jsonl"])  # killed mid-run
    args += ["--from-file", str(listing)]
    done = _predict(*args, "--resume")
    assert done.returncode == 1, done.stderr  # the unreadable inputs still count, recorded before or now
    assert not spool.exists()
    records = _read_back(out)
    assert len({r["input"] for r in records}) == len(records), "an input recorded twice"
    assert _same_records(records, reference["jsonl"]), f"killed at {killed_size} bytes"
    if seed == 1:  # a second resume of the finished file records nothing more (and prints no input error)
        again = _predict(*args, "--resume")
        assert "error: Cannot" not in again.stderr and _read_jsonl(out) == records


# Before the spool, the CSV case tore the file itself (a record short of rows); now a killed run tears
# the spool, whatever the format, and a finished .jsonl FILE torn by hand is resumed the same way.
@pytest.mark.parametrize("fmt, torn_file", [("jsonl", "spool"), ("csv", "spool"), ("jsonl", "output")])
def test_torn_last_record_is_cut_and_redone(fmt: str, torn_file: str, reference: dict, images: Path,
                                            tmp_path: Path) -> None:
    out = tmp_path / f"torn.{fmt}"
    torn = spool_path(out) if torn_file == "spool" else out
    names = [r["input"] for r in reference["jsonl"]][:9]
    _write_records(torn, reference["jsonl"][:6])
    lines = torn.read_bytes().splitlines(keepends=True)
    torn.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # half of the last line
    found = scan(torn, width=3, repair=False)
    assert found.records == 5 and found.torn > 0
    done = _predict(*names, "--output", str(out), "--resume")
    assert done.returncode == 0, done.stderr
    assert _same_records(_read_back(out), reference["jsonl"][:9]) and not spool_path(out).exists()


def test_resume_with_other_inputs_is_refused(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "other.jsonl"
    names = [r["input"] for r in reference["jsonl"]][:6]
    _write_records(out, reference["jsonl"][:4])
    before = out.read_bytes()
    done = _predict(*names[1:], "--output", str(out), "--resume")
    assert done.returncode == 1 and "--resume" in done.stderr and out.read_bytes() == before
    assert not spool_path(out).exists()  # the spool read back from the finished file is not left behind


MEMORY_PROBE = textwrap.dedent("""
    import resource, sys, tracemalloc
    from convnets.inference.predict import iter_inputs
    from convnets.inputs.listing import read_list as _read_list

    def peak(n, path):
        with open(path, "w") as f:
            for i in range(n):
                f.write(f"/no/such/dir/{i:07d}/some-photo-name.jpg\\n")
        tracemalloc.start()
        with open(path) as f:
            items = iter_inputs(_read_list(f), recursive=True)
            count = sum(1 for _ in items)
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert count == n
        return size
    small, large = peak(2_000, sys.argv[1]), peak(200_000, sys.argv[1])
    print(small, large, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
""")


def test_listed_inputs_stream_in_constant_memory(tmp_path: Path) -> None:
    """200,000 listed inputs cost no more Python memory than 2,000 (the listing is never held)."""
    proc = run_cli(str(tmp_path / "list.txt"), code=MEMORY_PROBE, timeout=120)
    assert proc.returncode == 0, proc.stderr
    small, large, _ = map(int, proc.stdout.split())
    assert large - small < 1_000_000, (small, large)  # a list of 200,000 paths would be ~25 MB


def test_many_listed_inputs_end_to_end_in_constant_memory(tmp_path: Path) -> None:
    """The whole command over 200,000 listed inputs: peak RSS within a few MB of 2,000 inputs.

    Each listed input is an empty folder, so that it becomes an error record without going through
    the image decoders (whose per-file thread hand-off would make this test slow): the listing,
    expansion, batching, writing and reporting all stream.
    """
    empty = tmp_path / "empty"
    empty.mkdir()
    # Both runs in one process, the small one first: the peak after it includes PyTorch (the zygote's
    # pages: tests/forked_cli.py) and the model, so the growth of the peak in the second run is what
    # 198,000 more inputs cost.
    code = textwrap.dedent("""
        import json, resource, sys
        from convnets.cli import main
        for argv in json.loads(sys.argv[1]):
            assert main(argv) == 1
            print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)  # KiB on Linux
    """)
    files = {}
    for n in (2_000, 200_000):
        listing = tmp_path / f"list{n}.txt"
        listing.write_text(f"{empty}\n" * n)
        files[n] = [str(listing), str(tmp_path / f"out{n}.jsonl")]
    runs = [["predict", *RANDOM, "--batch-size", "256", "--from-file", listing, "--output", out]
            for listing, out in files.values()]
    proc = run_cli(json.dumps(runs), code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = dict(zip((2_000, 200_000), (int(line) for line in proc.stderr.splitlines() if line.isdigit()), strict=True))
    for n, (_, out) in files.items():
        with open(out, encoding="utf-8") as f:
            assert sum(1 for _ in f) == n
    print(f"peak RSS: {rss[2_000] / 1024:.1f} MiB for 2,000 inputs, {rss[200_000] / 1024:.1f} MiB for 200,000")
    assert rss[200_000] - rss[2_000] < 30 * 1024, rss


def test_library_errors_are_convnets_errors_with_builtin_bases(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    from convnets.errors import InvalidArgumentError, MissingDependencyError
    from convnets.extras import install_hint

    with pytest.raises(InvalidArgumentError, match="output='a.txt': unknown format") as caught:
        Output.of("a.txt", "predictions")
    assert isinstance(caught.value, ValueError) and "--output a.txt" in caught.value.message_for("cli")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    with pytest.raises(MissingDependencyError, match=re.escape(install_hint("parquet"))) as missing:
        Output.of(tmp_path / "x.parquet", "predictions")
    assert isinstance(missing.value, ImportError)


def test_predict_takes_a_generator_and_keeps_batch_boundaries(images: Path) -> None:
    """The streaming entry reads inputs lazily, and ``start`` aligns batches as in an uninterrupted run."""
    from convnets.inference.predict import iter_inputs, iter_predict, predict_items

    names = [name for name, _ in iter_inputs([str(images / "part1")]) if Path(name).name.startswith("img")][:7]
    sizes: list[int] = []

    def model(batch: torch.Tensor) -> torch.Tensor:
        sizes.append(len(batch))
        return torch.zeros(len(batch), 3)
    pulled: list[str] = []

    def lazily() -> Iterator[str]:
        for name in names:
            pulled.append(name)
            yield name
    results = iter_predict(model, lazily(), labels=["a", "b", "c"], topk=1, batch_size=3)
    first = next(results)
    assert first.input == names[0] and pulled == names[:3]  # only the first batch was read
    assert [r.input for r in results] == names[1:] and sizes == [3, 3, 1]
    sizes.clear()
    # Resumed after 4 of them: the first batch completes the interrupted one (3 + 1 -> 2), then 3s.
    list(predict_items(model, ((n, None) for n in names[4:]), labels=["a", "b", "c"], batch_size=3, start=4))
    assert sizes == [2, 1]


def test_recursive_walk_skips_hidden_and_does_not_loop(tmp_path: Path) -> None:
    from convnets.inference.predict import iter_inputs

    for name in ("b.png", "a/c.jpg", "a/.d.png", "a/._e.png", ".f/g.png", "a/z/h.PNG", "i.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "a" / "loop").symlink_to(tmp_path / "a")  # a cycle: not entered
    (tmp_path / "link").symlink_to(tmp_path / "a" / "z")  # a link elsewhere: followed
    found = [Path(n).relative_to(tmp_path).as_posix() for n, _ in iter_inputs([str(tmp_path)], recursive=True)]
    assert found == ["a/c.jpg", "a/z/h.PNG", "b.png", "link/h.PNG"]
    assert [n for n, _ in iter_inputs([str(tmp_path)])] == [str(tmp_path / "b.png")]
    assert [n for n, _ in iter_inputs([str(tmp_path / ".f" / "g.png")])] == [str(tmp_path / ".f" / "g.png")]


# Before the spool, this scanned the .jsonl or .csv file itself; now a spool is scanned, and a finished
# .jsonl or .csv that --resume reads back into one is refused the same way, left as it was.
@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_damage_and_other_topk_are_refused_not_cut(fmt: str, reference: dict, tmp_path: Path) -> None:
    """Only what a killed writer leaves is cut away: a damaged middle or another --topk keeps the file as is."""
    from convnets.errors import InvalidArgumentError

    out = tmp_path / f"r.{fmt}"
    output = Output.of(out, "predictions")
    _write_records(output.spool(), reference["jsonl"][:5])
    spool = output.spool().read_bytes()
    with pytest.raises(InvalidArgumentError, match="holds 3 classes per input, this run 5"):
        scan(output.spool(), width=5)
    output.format.write(out, output.spool(), kind="predictions", width=3, batch_size=4)
    output.spool().unlink()
    written = out.read_bytes()
    with ExitStack() as stack, pytest.raises(InvalidArgumentError, match="holds 3 classes per input, this run 5"):
        output.open(output.spool(), resume=True, width=5, stack=stack)  # FILE read back, then refused
    assert out.read_bytes() == written and not output.spool().exists()
    for path, whole in ((output.spool(), spool), (out, written)):
        lines = whole.split(b"\n")
        lines[2] = b'garbage,"unclosed' if path == out and fmt == "csv" else b'{"input": "x", "top'
        path.write_bytes(b"\n".join(lines))
        with pytest.raises(InvalidArgumentError, match="damaged"), ExitStack() as stack:
            output.open(output.spool(), resume=True, width=3, stack=stack)
        assert path.read_bytes() == b"\n".join(lines)
        output.spool().unlink(missing_ok=True)


def test_the_inputs_are_listed_once_from_prepare_to_the_last_record(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare's checks (exists, holds images) and the run's records come from one walk: each folder of an INPUT
    is listed once (os.scandir counted in this process), and the records are every image, in path order."""
    import os

    root = tmp_path / "photos"
    for i, folder in enumerate(["a", "a/deep", "b"] * 2):
        (root / folder).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (20, 24), (i * 40, 0, 0)).save(root / folder / f"p{i}.png")
    listed: list[str] = []
    scandir = os.scandir

    def counting(path: object = ".") -> object:
        if isinstance(path, str) and Path(path).is_relative_to(root):  # not the runtimes' own listings
            listed.append(os.path.relpath(path, root))
        return scandir(path)
    monkeypatch.setattr(os, "scandir", counting)
    out = tmp_path / "out.jsonl"
    done = cli_in_process("predict", "--recursive", str(root), *MODEL, "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(listed) == [".", "a", "a/deep", "b"], listed
    records = [json.loads(line)["input"] for line in out.read_text().splitlines()]
    assert records == sorted(str(p) for p in root.rglob("*.png"))
