"""No writer follows a link it did not make, and none replaces a file unless asked (``--force`` / ``force=True``).

Each test plants what a careless or hostile neighbour could (a symbolic link where a file or a
directory goes, a hand-edited file, a killed run's leftovers) with real files in ``tmp_path`` and
runs the real command line (conftest.run_cli / start_cli), then checks what was written and where.
Tiny random-init models at 32 px (conftest.TINY).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TINY, run_cli, start_cli
from strict_skips import require_module

from convnets.errors import InvalidArgumentError
from convnets.fileio import make_output_dir, preflight, write_output

MODEL = ("--random-init", "--model", "resnet50", "--arch-kwargs", json.dumps(TINY["resnet50"]), "--image-size", "32")
THEIRS = "the user's own file\n"


def _victims(folder: Path, *names: str) -> dict[str, Path]:
    """Files of the user's outside the destination, one per name."""
    folder.mkdir(exist_ok=True)
    victims = {name: folder / name for name in names}
    for victim in victims.values():
        victim.write_text(THEIRS)
    return victims


def _untouched(victims: dict[str, Path]) -> bool:
    return all(v.read_text() == THEIRS for v in victims.values())


def _export(output: Path, *args: str) -> subprocess.CompletedProcess[str]:
    require_module("onnxruntime")
    return run_cli("export", *MODEL, "--output", str(output), *args)


def test_export_triton_writes_nothing_through_planted_links(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    version = repo / "resnet50" / "1"
    version.mkdir(parents=True)
    victims = _victims(tmp_path / "outside", "config.pbtxt", "README.md", "model.py")
    for name, victim in victims.items():
        (version if name == "model.py" else version.parent).joinpath(name).symlink_to(victim)
    args = ("--triton", "--triton-backend", "python")
    proc = _export(repo, *args)
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert "config.pbtxt exists (a symbolic link)" in line and "--force" in line
    assert _untouched(victims) and not (version / "model.onnx").exists()
    # --force replaces the links themselves: the files they pointed to stay as they were
    proc = _export(repo, *args, "--force")
    assert proc.returncode == 0, proc.stderr
    assert _untouched(victims)
    for name in victims:
        written = (version if name == "model.py" else version.parent) / name
        assert not written.is_symlink() and written.read_text() != THEIRS


@pytest.mark.parametrize("linked", ["resnet50", "resnet50/1"])
def test_export_writes_nothing_through_a_linked_directory_even_with_force(linked: str, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (repo / linked).parent.mkdir(parents=True, exist_ok=True)
    (repo / linked).symlink_to(elsewhere, target_is_directory=True)
    proc = _export(repo, "--triton", "--force")
    assert proc.returncode != 0
    assert f"{repo / linked} is a symbolic link" in proc.stderr
    assert list(elsewhere.iterdir()) == []


def test_a_re_export_replaces_nothing_without_force(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    assert _export(repo, "--triton").returncode == 0
    config, model = repo / "resnet50" / "config.pbtxt", repo / "resnet50" / "1" / "model.onnx"
    config.write_text(config.read_text() + "# tuned by hand\n")
    before = {p: p.read_bytes() for p in (config, model)}
    proc = _export(repo, "--triton")
    assert proc.returncode != 0
    assert f"{model} exists" in proc.stderr and "pass --force to replace it" in proc.stderr
    assert {p: p.read_bytes() for p in before} == before
    assert _export(repo, "--triton", "--force").returncode == 0
    assert "# tuned by hand" not in config.read_text()


def test_a_timm_export_keeps_an_existing_config_json_without_force(tmp_path: Path) -> None:
    require_module("timm")
    import convnets
    from convnets.deploy.export import export_model

    config = tmp_path / "config.json"
    config.write_text(THEIRS)
    with pytest.raises(InvalidArgumentError, match="config.json exists") as refused:  # before the slow part
        export_model(convnets.resnet50().eval(), tmp_path / "model.safetensors", format="timm", image_size=32)
    assert refused.value.keyword == "force" and "force=True" in str(refused.value)
    assert config.read_text() == THEIRS and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_a_killed_export_leaves_nothing_the_next_run_trips_over(tmp_path: Path) -> None:
    require_module("onnxruntime")
    out = tmp_path / "out"
    out.mkdir()
    proc = start_cli("export", *MODEL, "--output", str(out))
    deadline = time.monotonic() + 120
    while not list(out.glob(".*.partial")):
        assert proc.poll() is None, "the export ended before it could be killed mid-export"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert list(out.glob(".*.partial"))  # what a kill -9 leaves
    proc2 = run_cli("export", *MODEL, "--output", str(out))
    assert proc2.returncode == 0, proc2.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx"]


def test_benchmark_output_replaces_nothing_and_writes_through_no_link(tmp_path: Path) -> None:
    bench = ("benchmark", *MODEL, "--engine", "torch", "--no-compile", "--batch-sizes", "1", "--warmup", "1",
             "--iterations", "1")
    existing = tmp_path / "bench.json"
    existing.write_text(THEIRS)
    victims = _victims(tmp_path / "outside", "victim.json")
    link = tmp_path / "link.json"
    link.symlink_to(victims["victim.json"])
    for path, option in ((existing, "--output"), (link, "--output"), (existing, "--json")):
        proc = run_cli(*bench, option, str(path))
        assert proc.returncode == 2 and f"{option}: {path} exists" in proc.stderr and "--force" in proc.stderr
    assert existing.read_text() == THEIRS and _untouched(victims)
    proc = run_cli(*bench, "--output", str(link), "--force")
    assert proc.returncode == 0, proc.stderr
    assert _untouched(victims) and not link.is_symlink() and json.loads(link.read_text())["results"]


@pytest.mark.parametrize("command", ["export", "benchmark", "evaluate", "plot"])
def test_an_output_name_of_bytes_that_are_not_utf8_is_one_usage_error(command: str, tmp_path: Path) -> None:
    name = os.fsdecode(b"\xff.json")
    args = {"export": ("export", *MODEL), "benchmark": ("benchmark", *MODEL), "plot": ("plot", str(tmp_path)),
            "evaluate": ("evaluate", "--data", str(tmp_path), *MODEL[:-2])}[command]
    proc = run_cli(*args, "--output", name, cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line]
    assert "argument --output" in line and "\\xff.json" in line and "not UTF-8" in line
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_evaluate_keeps_an_earlier_report_without_force(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text(THEIRS)
    proc = run_cli("evaluate", "--data", str(tmp_path), *MODEL[:-2], "--output", str(out))
    assert proc.returncode == 2 and "report.json exists" in proc.stderr and "--force" in proc.stderr
    assert (out / "report.json").read_text() == THEIRS


def test_plot_replaces_its_figure_only_with_force_and_never_through_a_link(tmp_path: Path) -> None:
    require_module("matplotlib")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_loss": 2.0, "val_top1": 10.0}) + "\n")
    assert run_cli("plot", str(tmp_path)).returncode == 0
    figure = (tmp_path / "curves.png").read_bytes()
    proc = run_cli("plot", str(tmp_path))
    assert proc.returncode != 0 and "curves.png exists" in proc.stderr and "--force" in proc.stderr
    assert (tmp_path / "curves.png").read_bytes() == figure
    victims = _victims(tmp_path / "outside", "victim.png")
    link = tmp_path / "link.png"
    link.symlink_to(victims["victim.png"])
    assert run_cli("plot", str(tmp_path), "--output", str(link)).returncode != 0
    assert run_cli("plot", str(tmp_path), "--output", str(link), "--force").returncode == 0
    assert _untouched(victims) and not link.is_symlink()


def test_train_metrics_are_never_appended_through_a_link(tmp_path: Path) -> None:
    from convnets.train.metrics import append_metrics

    victims = _victims(tmp_path / "outside", "victim.jsonl")
    (tmp_path / "metrics.jsonl").symlink_to(victims["victim.jsonl"])
    with pytest.raises(OSError):
        append_metrics(tmp_path / "metrics.jsonl", {"epoch": 1})
    assert _untouched(victims)


def test_triton_labels_are_not_written_through_a_link(tmp_path: Path) -> None:
    from convnets.deploy.triton import write_labels

    victims = _victims(tmp_path / "outside", "labels.txt")
    (tmp_path / "labels.txt").symlink_to(victims["labels.txt"])
    with pytest.raises(InvalidArgumentError, match="labels.txt exists"):
        write_labels(tmp_path, ["cat", "dog"])
    write_labels(tmp_path, ["cat", "dog"], force=True)
    assert _untouched(victims) and (tmp_path / "labels.txt").read_text() == "cat\ndog\n"


def test_the_helpers_refuse_links_below_the_named_directory_and_keep_what_exists(tmp_path: Path) -> None:
    base = tmp_path / "base"
    assert make_output_dir(base / "a" / "b", base=base).is_dir()
    (base / "link").symlink_to(tmp_path, target_is_directory=True)
    for attempt in (lambda: make_output_dir(base / "link" / "x", base=base),
                    lambda: write_output(base / "link" / "f", lambda f: f.write(b"x"), force=True, base=base),
                    lambda: preflight(base / "a" / "b", base=base)):
        with pytest.raises(InvalidArgumentError):
            attempt()
    assert not (tmp_path / "x").exists() and not (tmp_path / "f").exists()
    # a link in the directory the user named is his own choice: followed
    (tmp_path / "mine").symlink_to(base, target_is_directory=True)
    write_output(tmp_path / "mine" / "a" / "f", lambda f: f.write(b"ok"), base=tmp_path / "mine")
    assert (base / "a" / "f").read_bytes() == b"ok"


def test_a_directory_swapped_for_a_link_mid_write_gets_nothing_through_the_link(tmp_path: Path) -> None:
    """The writer works relative to the directory it opened: a neighbour who renames the directory and plants a
    link in its place while the file is being written does not redirect the file (a path-based rename would)."""
    base, outside = tmp_path / "base", tmp_path / "outside"
    (base / "a").mkdir(parents=True)
    outside.mkdir()

    def write(f) -> None:
        f.write(b"mine")
        (base / "a").rename(base / "moved")
        (base / "a").symlink_to(outside, target_is_directory=True)

    write_output(base / "a" / "f", write, base=base)
    assert list(outside.iterdir()) == [] and (base / "moved" / "f").read_bytes() == b"mine"
    assert [p.name for p in (base / "moved").iterdir()] == ["f"]  # no temporary file left either
    with pytest.raises(InvalidArgumentError, match="is a symbolic link"):  # the next write sees the link
        write_output(base / "a" / "g", lambda f: f.write(b"x"), base=base)
