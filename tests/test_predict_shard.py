"""``convnets predict`` sharded over processes: ``torchrun --nproc-per-node 2`` (gloo, CPU) against one process.

The torchrun runs are real (``python -m torch.distributed.run``, forked with its ranks from an
interpreter that has imported PyTorch: ``forked_cli.torchrun``), and few: one per output format,
and two resumes. Their merged files are compared
byte for byte with a single process's and read back with the standard readers (json, csv, pyarrow).
The partition itself (:mod:`convnets.inference.shard`) is tested without processes.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import forked_cli
import numpy as np
import pytest
import torch
from conftest import REPO, TINY
from PIL import Image
from strict_skips import require_module

import convnets
from convnets.errors import InvalidArgumentError
from convnets.inference.outputs import Output
from convnets.inference.outputs.csv import COLUMNS as CSV_COLUMNS
from convnets.inference.outputs.spool import read_spool, spool_path, write_spool
from convnets.inference.shard import interleave, shard_count, shard_items

BATCH = 3
N_GOOD = 31  # + 4 unreadable = 35 inputs: 12 batches, 6 per rank, the last one short (18 and 17 inputs)


def _env() -> dict[str, str]:
    # One thread per process (as torchrun sets for several): the same arithmetic in every run.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("CONVNETS_DEBUG", None)
    return env


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny model's checkpoint, a folder of images with two unreadable ones (one on each rank), a
    list of only the readable ones, and the single-process output files for them."""
    root = tmp_path_factory.mktemp("shard")
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", **TINY["resnet50"])
    ckpt = root / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, ckpt)
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(N_GOOD):
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(images / f"img{i:03d}.png")
    (images / "img004_bad.png").write_bytes(b"not an image")  # input 5: batch 1, rank 1
    good = (images / "img000.png").read_bytes()
    (images / "img007_cut.png").write_bytes(good[: len(good) // 2])  # input 9: batch 3, rank 1
    (images / "img013_bad.jpg").write_bytes(b"\xff\xd8\xff" + bytes(100))  # input 16: batch 5, rank 1
    (images / "img020_bad.png").write_bytes(b"nope")  # input 24: batch 8, rank 0
    listing = root / "good.txt"
    listing.write_text("".join(f"{images / f'img{i:03d}.png'}\n" for i in range(N_GOOD)))
    args = ["predict", "--weights", str(ckpt), "--image-size", "32", "--batch-size", str(BATCH), "--topk", "3",
            "--no-progress"]
    single = root / "single"
    single.mkdir()
    # The single-process runs.
    runs = [forked_cli.run(run, env=_env(), cwd=REPO, timeout=300) for run in (
        [*args, str(images), "--output", str(single / "all.jsonl")],
        [*args, str(images), "--output", str(single / "all.csv")],
        [*args, "--from-file", str(listing), "--output", str(single / "good.parquet")])]
    assert [run.returncode for run in runs] == [1, 1, 0], [run.stderr[-3000:] for run in runs]
    assert sorted(_error_lines(runs[0].stderr)) == sorted(_error_lines(runs[1].stderr))  # the same 4, from both
    return {"root": root, "args": args, "images": images, "listing": listing, "single": single,
            "errors": sorted(_error_lines(runs[0].stderr))}


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 -m convnets ARGS`` (torchrun need not be on PATH)."""
    return forked_cli.torchrun(["--standalone", "--nproc-per-node", "2", "-m", "convnets", *args], env=_env(),
                               cwd=REPO, timeout=300)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("convnets predict: error:")]


def _summary_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("convnets predict: ") and "could not" in line]


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
        return list(reader)


def _only_file(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_two_ranks_write_the_single_process_file(setup: dict, tmp_path: Path) -> None:
    """JSONL here; CSV in the resume test below, Parquet in the next one."""
    out = tmp_path / "all.jsonl"
    proc = torchrun(*setup["args"], str(setup["images"]), "--output", str(out))
    expected = setup["single"] / "all.jsonl"
    assert proc.returncode == 1, proc.stderr[-3000:]  # unreadable inputs on both ranks: the run fails
    assert out.read_bytes() == expected.read_bytes()
    assert _only_file(tmp_path) == [out.name], proc.stderr  # the parts are gone
    # Each rank reported its own unreadable inputs; rank 0 alone the total over both.
    assert sorted(_error_lines(proc.stderr)) == setup["errors"] and len(setup["errors"]) == 4, proc.stderr
    assert _summary_lines(proc.stderr) == [f"convnets predict: 4 of {N_GOOD + 4} inputs could not be read"], \
        proc.stderr
    # Read back with json: every input once, in the folder's order.
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["input"] for r in records] == sorted(str(p) for p in setup["images"].iterdir())
    assert sum("error" in r for r in records) == 4


def test_parquet_merge_and_a_clean_run_exits_zero(setup: dict, tmp_path: Path) -> None:
    pq = require_module("pyarrow.parquet")
    out = tmp_path / "good.parquet"
    proc = torchrun(*setup["args"], "--from-file", str(setup["listing"]), "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _summary_lines(proc.stderr) and not _error_lines(proc.stderr)
    expected = setup["single"] / "good.parquet"
    table = pq.read_table(out)
    assert table.equals(pq.read_table(expected)) and table.num_rows == N_GOOD
    assert out.read_bytes() == expected.read_bytes()
    assert pq.ParquetFile(out).num_row_groups == -(-N_GOOD // BATCH)  # a row group per batch, as one process
    assert _only_file(tmp_path) == [out.name], proc.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_one_failing_input_fails_both(setup: dict, tmp_path: Path) -> None:
    """Two torchrun agents as two machines (``--nnodes 2``, one process each): only rank 1 meets an
    unreadable input, and both machines' runs end in status 1 (the counts are summed over ranks)."""
    out = tmp_path / "six.jsonl"
    inputs = sorted(str(p) for p in setup["images"].iterdir())[:6]  # batch 0 on rank 0, batch 1 (input 5 bad) on 1
    listing = tmp_path / "six.txt"
    listing.write_text("".join(f"{name}\n" for name in inputs))
    port = _free_port()
    agents = [forked_cli.CliProcess(
        ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
         "--master-port", str(port), "-m", "convnets", *setup["args"], "--from-file", str(listing), "--output",
         str(out)], module="torch.distributed.run", cwd=REPO, env=forked_cli.torchrun_env(_env()),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in (0, 1)]
    err0, err1 = (forked_cli.text(agent.communicate(timeout=300)[1]) for agent in agents)
    assert [agent.returncode for agent in agents] == [1, 1], err0[-3000:] + err1[-3000:]
    assert not _error_lines(err0) and len(_error_lines(err1)) == 1 and "img004_bad.png" in err1
    assert _summary_lines(err0) == ["convnets predict: 1 of 6 inputs could not be read"] and not _summary_lines(err1)
    expected = (setup["single"] / "all.jsonl").read_bytes().splitlines(keepends=True)[:6]  # the same batches
    assert out.read_bytes() == b"".join(expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["six.jsonl", "six.txt"]


def _cut(path: Path, records: int) -> None:
    """Keep the first ``records`` records of the spool ``path`` and 7 bytes of the next (a killed writer's torn tail)."""
    data = path.read_bytes()
    size = len(b"".join(data.splitlines(keepends=True)[:records]))
    assert data[size - 1:size] == b"\n" and len(data) > size + 7
    path.write_bytes(data[:size + 7])


def test_resume_continues_each_ranks_part(setup: dict, tmp_path: Path) -> None:
    """Part spools that a killed sharded run left (torn in the middle of a line) are resumed, each by its
    rank; the merged file is the uninterrupted run's."""
    expected = setup["single"] / "all.jsonl"
    out = tmp_path / "all.jsonl"
    shutil.copy(expected, out)
    Output.of(out, "predictions").split(2, BATCH)  # what --resume under torchrun does with a finished file
    parts = [spool_path(out, rank, 2) for rank in (0, 1)]
    assert [sum(1 for _ in read_spool(p)) for p in parts] == [shard_count(N_GOOD + 4, r, 2, BATCH) for r in (0, 1)] \
        == [18, 17]
    out.unlink()  # killed before the merge: only the parts
    _cut(parts[0], 5 * BATCH)  # rank 0 stopped in its sixth batch (the run's 11th), rank 1 in its second
    _cut(parts[1], 1 * BATCH)
    proc = torchrun(*setup["args"], str(setup["images"]), "--output", str(out), "--resume")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert out.read_bytes() == expected.read_bytes()
    assert _only_file(tmp_path) == [out.name], proc.stderr
    # Both ranks continued their parts: rank 0 had recorded input 24, rank 1 input 5 and now redid 9 and 16.
    assert _summary_lines(proc.stderr) == [
        f"convnets predict: 4 of {N_GOOD + 4} inputs could not be read (2 recorded by the earlier run)"], proc.stderr


# Before the spool, a killed single process left a torn all.csv; now it leaves all.csv.partial.jsonl
# (the lines of all.jsonl), torn the same way, which rank 0 splits.
def test_resume_splits_a_single_process_spool(setup: dict, tmp_path: Path) -> None:
    """A single process's spool, killed mid-line, resumed by two processes: rank 0 splits its records into
    parts, each rank continues its own, and the merge is the uninterrupted file."""
    expected = setup["single"] / "all.csv"
    out = tmp_path / "all.csv"
    shutil.copy(setup["single"] / "all.jsonl", spool_path(out))  # a spool holds the lines of the JSONL file
    _cut(spool_path(out), 7 * BATCH)
    proc = torchrun(*setup["args"], str(setup["images"]), "--output", str(out), "--resume")
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = _read_csv(out)  # read back with csv: 3 rows per image, one per unreadable input
    bad = ("img004_bad.png", "img007_cut.png", "img013_bad.jpg", "img020_bad.png")
    assert len(rows) == 3 * N_GOOD + 4 and [r["input"] for r in rows if r["error"]] == [
        str(setup["images"] / name) for name in bad]
    # The 21 records kept (inputs 5, 9 and 16 unreadable) were split into parts and not redone.
    assert _summary_lines(proc.stderr) == [
        f"convnets predict: 4 of {N_GOOD + 4} inputs could not be read (3 recorded by the earlier run)"], proc.stderr
    assert out.read_bytes() == expected.read_bytes()
    assert _only_file(tmp_path) == [out.name], proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--jsonl"], "under torchrun (2 processes) each process writes its share of the records to a part of the "
                  "output file, which rank 0 merges at the end: pass --output FILE"),
    (["--output", "x.jsonl", "--from-file", "-"], "cannot come from standard input: write them to a file and "
                                                     "pass --from-file FILE"),
    (["--output", "x.jsonl"], "x.jsonl.part-00001-of-00002.partial.jsonl exists: a stopped run left it; pass --resume"),
    (["--output", "y.jsonl", "--show", "y.png"], "--show draws the contact sheets in one process, not under "
                                                 "torchrun"),
])
def test_what_a_sharded_run_refuses(args: list[str], message: str, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Refused before the model loads and before any process group (so no torchrun is needed)."""
    from convnets.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "x.jsonl.part-00001-of-00002.partial.jsonl").write_text("")
    (tmp_path / "a.png").write_bytes(b"")  # an INPUT that exists (checked first); refused before it is read
    assert main(["predict", "--random-init", "--model", "resnet50", *args, "a.png"]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("command", [
    ["predict", "--random-init", "--model", "resnet50", "--output", "x.jsonl", "a.png"],
    ["embed", "--random-init", "--model", "resnet50", "--output", "x.npy", "a.png"],
    ["train", "--data", ".", "--output", "out"],
])
def test_a_rank_outside_the_world_is_one_clear_error(command: list[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture) -> None:
    """Every command reads the job from convnets.dist.rank_world, which names the variables."""
    from convnets.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "a.png").write_bytes(b"")  # an INPUT that exists (checked first); refused before it is read
    assert main(command) == 1
    err = capsys.readouterr().err
    assert "RANK=2 and WORLD_SIZE=2: need 0 <= RANK < WORLD_SIZE" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("rank", "world", "total", "show"), [(0, 1, 10, True), (0, 2, 6, True), (1, 2, 4, False),
                                                              (2, 3, 2, False)])
def test_the_progress_bar_counts_this_ranks_shard_and_only_rank_0_shows_it(rank: int, world: int, total: int,
                                                                           show: bool, tmp_path: Path) -> None:
    """Ten named files in batches of 2: batches 0..4, batch k on rank k % world (counted by hand)."""
    import argparse

    from convnets.inference.job import progress as progress_from_args
    from convnets.inference.shard import ShardedRun

    args = argparse.Namespace(inputs=[f"img{i}.png" for i in range(10)], recursive=False, from_file=None,
                              progress=True, batch_size=2)
    run = ShardedRun(rank, world, batch_size=2)
    assert progress_from_args(args, True, run) == (total, show)
    args.inputs.append(str(tmp_path))  # a directory: the total would need a listing, so there is none
    assert progress_from_args(args, True, run) == (None, show)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_shards_partition_the_inputs_by_batch(world: int, batch_size: int) -> None:
    for n in (0, 1, batch_size * world - 1, batch_size * world, 29):
        items = [f"x{i}" for i in range(n)]
        shards = [list(shard_items(iter(items), rank, world, batch_size)) for rank in range(world)]
        assert sorted(sum(shards, [])) == sorted(items) and len(sum(shards, [])) == n  # each exactly once
        for rank, shard in enumerate(shards):
            assert shard == [x for i, x in enumerate(items) if (i // batch_size) % world == rank]  # order kept
            assert shard == list(shard_items(items, rank, world, batch_size))  # the same every time
            assert len(shard) == shard_count(n, rank, world, batch_size)
        batches = list(interleave(shards, batch_size))
        assert sum(batches, []) == items  # the merge restores the run's order
        assert batches == [items[i:i + batch_size] for i in range(0, n, batch_size)]  # and its batches


def test_interleave_refuses_parts_of_other_runs() -> None:
    with pytest.raises(InvalidArgumentError, match="not the parts of one run"):
        list(interleave([[1, 2], [3, 4, 5, 6]], 2))  # shard 0 ends, shard 1 goes on
    with pytest.raises(InvalidArgumentError, match="not the parts of one run"):
        list(interleave([[1, 2, 3], [4]], 2))  # shard 1's batch is short, shard 0 goes on
    with pytest.raises(InvalidArgumentError, match="rank"):
        list(shard_items([1], 2, 2, 1))


def test_part_spool_names(tmp_path: Path) -> None:
    assert spool_path("runs/out.jsonl") == Path("runs/out.jsonl.partial.jsonl")
    assert spool_path("runs/out.jsonl", 1, 2) == Path("runs/out.jsonl.part-00001-of-00002.partial.jsonl")
    assert spool_path("out.parquet", 11, 16).name == "out.parquet.part-00011-of-00016.partial.jsonl"
    with pytest.raises(InvalidArgumentError, match="cannot merge"):
        Output.of(tmp_path / "out.jsonl", "predictions").finish(world=2, batch_size=4, width=1)


# Before the spool, parts were files of the output's format (write_records / read_records); now they
# are spools, and every format is written from the merged spool and read back by its own reader.
@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_records_round_trip_through_parts(fmt: str, tmp_path: Path) -> None:
    """Each format written from a spool and read back, split into parts and merged, without processes."""
    if fmt == "parquet":
        require_module("pyarrow")
    records = [{"input": f"i{n}.png", "error": "Cannot load"} if n % 4 == 1 else
               {"input": f"i{n}.png", "top": [{"index": n, "label": f"l,\"{n}\"", "probability": 1 / (n + 3)}]}
               for n in range(10)]
    output = Output.of(tmp_path / f"r.{fmt}", "predictions")
    write_spool(output.spool(), records)
    assert output.finish(world=1, batch_size=3, width=1) == 10
    assert list(output.format.read(output.path, "predictions")) == records
    before = output.path.read_bytes()
    output.split(3, 3)
    assert [sum(1 for _ in read_spool(output.spool(rank, 3))) for rank in range(3)] == [4, 3, 3]
    output.path.unlink()
    assert output.finish(world=3, batch_size=3, width=1) == 10
    assert output.path.read_bytes() == before and _only_file(tmp_path) == [output.path.name]


def test_embed_two_ranks_write_the_single_process_file(setup: dict, tmp_path: Path) -> None:
    """``convnets embed`` shards like predict: the parts are spools, rank 0 assembles FILE from all of
    them; the .npy and its inputs list equal one process's byte for byte."""
    args = ["embed", "--weights", setup["args"][2], "--image-size", "32", "--batch-size", str(BATCH),
            "--no-progress", str(setup["images"])]
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir()
    sharded.mkdir()
    proc = forked_cli.run([*args, "--output", str(single / "vecs.npy")], cwd=REPO, env=_env(), timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]  # the 4 unreadable inputs
    proc = torchrun(*args, "--output", str(sharded / "vecs.npy"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (sharded / "vecs.npy").read_bytes() == (single / "vecs.npy").read_bytes()
    assert (sharded / "vecs.npy.inputs.txt").read_text() == (single / "vecs.npy.inputs.txt").read_text()
    assert np.load(sharded / "vecs.npy").shape[0] == N_GOOD
    assert _only_file(sharded) == ["vecs.npy", "vecs.npy.inputs.txt"], proc.stderr  # no part spools left
    errors = [line for line in proc.stderr.splitlines() if line.startswith("convnets embed: error:")]
    assert len(errors) == 4, proc.stderr


# Before, a spool left by one process was refused under torchrun; now every spool is JSON lines and
# is split into parts like a prediction spool, so the embed case is split too (no torchrun needed here).
def test_a_single_process_embed_spool_is_split_into_parts(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    records = [{"input": f"img{i}.jpg", "embedding": rng.standard_normal(3).astype(np.float32)} for i in range(7)]
    output = Output.of(tmp_path / "v.npy", "embeddings")
    write_spool(output.spool(), records)
    output.spool().write_bytes(output.spool().read_bytes()[:-5])  # killed mid-line
    output.split(2, 2)
    assert not output.spool().exists()
    parts = [[r["input"] for r in read_spool(output.spool(rank, 2), "embeddings")] for rank in (0, 1)]
    assert parts == [["img0.jpg", "img1.jpg", "img4.jpg", "img5.jpg"], ["img2.jpg", "img3.jpg"]]
