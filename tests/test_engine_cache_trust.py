"""The engine cache trusts only what the current user wrote, deletes nothing outside itself, and stays bounded.

Each test plants what a careless or hostile neighbour could (a manifest naming files elsewhere, a
link, a FIFO, another user's entry, a writable cache directory, a bad verdict, escape sequences) in
a cache that a real conversion filled, and checks what the package then reads, uses and removes.
"Another user" is a real ``os.chown`` to ``nobody`` (65534), so those cases need root; group and
others' write permission is a real ``chmod``. Tiny models (conftest.TINY) at 64 px, as in
test_engine_cache.py, whose helpers these tests share (``conversions``: conftest.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY
from strict_skips import require_module
from test_engine_cache import SIZE, entries, images, tiny

from convnets.cli import main
from convnets.deploy import cache as engine_cache
from convnets.deploy.export import Verification
from convnets.deploy.formats.onnx import OnnxFormat
from convnets.deploy.optimize import optimize_for_inference
from convnets.errors import InvalidArgumentError

pytestmark = pytest.mark.usefixtures("cold_engine_cache")

NOBODY = 65534
AS_ROOT = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="giving a file to another user (os.chown) needs root")
LOGGER = "convnets.deploy.cache"


def build(seed: int = 0, **kwargs: object) -> torch.nn.Module:
    require_module("onnxruntime")
    return optimize_for_inference(tiny(seed), engine="onnxruntime", **kwargs)


def only_entry() -> Path:
    (entry,) = entries()
    return entry


def manifest_of(entry: Path) -> dict:
    return json.loads((entry / "entry.json").read_text())


def rewrite_manifest(entry: Path, change: Callable[[dict], object]) -> None:
    manifest = manifest_of(entry)
    change(manifest)
    (entry / "entry.json").write_text(json.dumps(manifest))


def files_in(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


# --- entries are read and removed only inside the cache -------------------------------------------


@pytest.mark.parametrize("how", ["cache clear", "rebuild"])
def test_a_manifest_naming_files_elsewhere_deletes_nothing_outside_the_entry(
        how: str, tmp_path: Path, conversions: dict[str, int]) -> None:
    build()
    entry = only_entry()
    beside = entry.parent / "victim"  # ../victim from the entry
    outside = tmp_path / "victim"  # an absolute name
    for victim in (beside, outside):
        victim.write_text("the user's")
    record = {"size": 10, "sha256": "0" * 64}
    rewrite_manifest(entry, lambda m: m["files"].update({"../victim": record, str(outside): record}))
    if how == "cache clear":
        assert main(["cache", "clear"]) == 0
        assert not entry.exists()
    else:
        (entry / "model.onnx").write_bytes(b"truncated")  # so that even a manifest read as before is stale
        build()
        assert conversions["onnxruntime"] == 2
    assert beside.read_text() == "the user's" and outside.read_text() == "the user's"


def test_an_entry_that_is_a_link_is_neither_used_nor_emptied(tmp_path: Path, conversions: dict[str, int],
                                                              caplog: pytest.LogCaptureFixture,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    build()
    entry = only_entry()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(entry, elsewhere)  # a complete entry for this very key, planted outside the cache
    shutil.rmtree(entry)
    entry.symlink_to(elsewhere, target_is_directory=True)
    before = files_in(elsewhere)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model = build()
        build()
    assert conversions["onnxruntime"] == 3 and engine_cache.entry_of(model) is None
    (warning,) = warnings(caplog, "symbolic link")
    assert str(entry) in warning and "\n" not in warning
    assert main(["cache", "list"]) == 0 and "0 entries" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert entry.is_symlink() and files_in(elsewhere) == before


def test_a_fifo_in_an_entry_makes_it_a_bad_entry_not_a_hang(conversions: dict[str, int],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    expected = build()(images())
    entry = only_entry()
    (entry / "model.onnx").unlink()
    os.mkfifo(entry / "model.onnx")
    # The manifest agrees with what a FIFO reads as before anyone writes to it: no bytes.
    empty = engine_cache.keys.digest([])
    rewrite_manifest(entry, lambda m: m["files"].update({"model.onnx": {"size": 0, "sha256": empty}}))
    result: dict[str, torch.Tensor] = {}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        worker = threading.Thread(target=lambda: result.update(logits=build()(images())), daemon=True)
        worker.start()
        worker.join(120)
    assert not worker.is_alive(), "a FIFO named model.onnx made the build wait for a writer"
    assert conversions["onnxruntime"] == 2
    torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)
    (warning,) = warnings(caplog, "rebuilding")
    assert "not a regular file" in warning
    assert stat.S_ISREG(os.lstat(only_entry() / "model.onnx").st_mode)


# --- entries someone else could have written are ignored -----------------------------------------


def _group_writable(path: Path) -> None:
    path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o020)


def _others_writable(path: Path) -> None:
    path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o002)


def _nobodys(path: Path) -> None:
    os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


@pytest.mark.parametrize("target, change", [
    ("", _group_writable),
    ("entry.json", _others_writable),
    ("verdict.json", _group_writable),
    pytest.param("", _nobodys, marks=AS_ROOT),
    pytest.param("model.onnx", _nobodys, marks=AS_ROOT),
], ids=["entry g+w", "entry.json o+w", "verdict.json g+w", "entry nobody's", "model.onnx nobody's"])
def test_an_entry_someone_else_could_have_written_is_ignored_with_one_warning_and_kept(
        target: str, change: Callable[[Path], None], conversions: dict[str, int],
        caplog: pytest.LogCaptureFixture) -> None:
    build()
    entry = only_entry()
    if target == "verdict.json":
        (entry / "verdict.json").write_text("{}")
        (entry / "verdict.json").chmod(0o644)
    change(entry / target if target else entry)
    before = files_in(entry)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first, second = build(), build()
    assert conversions["onnxruntime"] == 3  # converted each time: nothing of that entry was used
    assert engine_cache.entry_of(first) is None and engine_cache.entry_of(second) is None
    (warning,) = warnings(caplog, "ignoring")
    assert str(entry) in warning and "\n" not in warning
    assert entries() == [entry] and files_in(entry) == before  # not removed, not replaced


@pytest.mark.parametrize("change", [
    lambda root: root.chmod(0o777),
    lambda root: root.chmod(0o775),
    pytest.param(_nobodys, marks=AS_ROOT),
], ids=["o+w", "g+w", "nobody's"])
def test_a_cache_directory_someone_else_can_write_is_neither_read_nor_written(
        change: Callable[[Path], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        conversions: dict[str, int], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "shared"
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(root))
    build()  # an entry of ours, made while the directory was private
    (entry,) = root.iterdir()
    change(root)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        build()
        build()
    assert conversions["onnxruntime"] == 3
    (warning,) = warnings(caplog, str(root))
    assert "CONVNETS_CACHE_DIR" in warning and "\n" not in warning
    assert list(root.iterdir()) == [entry]
    assert main(["cache", "clear"]) == 1
    err = capsys.readouterr().err
    assert "CONVNETS_CACHE_DIR" in err and str(root) in err
    assert list(root.iterdir()) == [entry]


def test_predict_in_a_cache_directory_others_can_write_predicts_without_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    require_module("onnxruntime")
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(root))
    image = REPO / "convnets" / "assets" / "examples" / "coffee.png"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        code = main(["predict", "--random-init", "--model", "resnet50", "--arch-kwargs", json.dumps(TINY["resnet50"]),
                     "--image-size", str(SIZE), "--engine", "onnxruntime", "--jsonl", "--topk", "1", str(image)])
    assert code == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["input"] == str(image) and len(record["top"]) == 1
    assert len(warnings(caplog, "CONVNETS_CACHE_DIR")) == 1
    assert list(root.iterdir()) == []


def test_a_root_swapped_after_its_check_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    conversions: dict[str, int]) -> None:
    """Whoever can write the root's parent renames another directory in right after the root's check:
    the cache keeps working in the directory it checked, and the planted graph is never loaded."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(root))
    expected = build(0)(images())
    (ours,) = root.iterdir()
    other = build(1)
    planted = tmp_path / "planted"
    shutil.copytree(root, planted, ignore=lambda folder, names: [n for n in names if n != ours.name]
                    if Path(folder) == root else [])
    graph = planted / ours.name / "model.onnx"
    shutil.copyfile(_path(other) / "model.onnx", graph)  # another model's graph, its digest recorded to match
    rewrite_manifest(planted / ours.name, lambda m: m["files"].update(
        {"model.onnx": {"size": graph.stat().st_size, "sha256": engine_cache.disk.file_digest(graph)}}))
    checked = os.stat(root)
    original = engine_cache.disk._foreign
    swapped = []

    def racing(st: os.stat_result) -> str | None:
        verdict = original(st)
        if not swapped and (st.st_dev, st.st_ino) == (checked.st_dev, checked.st_ino):
            root.rename(tmp_path / "moved")
            planted.rename(root)
            swapped.append(True)
        return verdict
    monkeypatch.setattr(engine_cache.disk, "_foreign", racing)
    got = build(0)(images())
    assert swapped and conversions["onnxruntime"] == 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # the checked directory's graph


@pytest.mark.parametrize("how", ["eviction", "cache clear"])
def test_folders_that_merely_look_like_entries_are_never_touched(how: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """CONVNETS_CACHE_DIR=$HOME with a size limit: the user's folders named like entries (one even with
    an entry.json naming its files) keep their names and every file; only the cache's entries go."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(home))
    monkeypatch.setenv("CONVNETS_CACHE_MAX_SIZE", "1")  # nothing fits: every entry but the newest goes
    theirs = {}
    for i, manifest in enumerate(([], ["report.pdf"])):
        folder = home / f"onnxruntime-{i:032x}"
        folder.mkdir(mode=0o755)
        (folder / "report.pdf").write_bytes(b"%PDF the user's")
        if manifest:
            (folder / "entry.json").write_text(json.dumps({"files": {n: {} for n in manifest}}))
        os.utime(folder, (1_600_000_000, 1_600_000_000))  # the least recently "used"
        theirs[folder] = files_in(folder)
    first = _path(build(0))
    second = _path(build(1))
    if how == "cache clear":
        assert main(["cache", "clear"]) == 0
        assert not second.exists()
    assert not first.exists()
    assert {folder: files_in(folder) for folder in theirs} == theirs
    assert sorted(p.name for p in home.iterdir() if p.name.startswith(".")) == []  # none renamed away


# --- verdict.json and entry.json are checked against their schema ---------------------------------


@pytest.mark.parametrize("recorded", [
    {"passed": False},
    {"passed": True},
    "full record, min_cosine as text",
], ids=["passed false alone", "passed true alone", "a field of another type"])
def test_a_verdict_of_another_schema_counts_as_none_and_is_recorded_anew(
        recorded: object, monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("openvino")
    import convnets.deploy.export as export

    model = tiny()
    first = optimize_for_inference(model, engine="auto")
    assert first.engine == "openvino"
    entry = engine_cache.entry_of(first)
    assert entry is not None
    verdict_file = entry.path / "verdict.json"
    good = json.loads(verdict_file.read_text())
    if recorded == "full record, min_cosine as text":
        recorded = {**good["auto"], "min_cosine": "0.99999"}
    verdict_file.write_text(json.dumps({"key": good["key"], "auto": recorded}))
    checks = []
    original = export.verify_runner
    monkeypatch.setattr(export, "verify_runner", lambda *a, **k: checks.append(1) or original(*a, **k))
    second = optimize_for_inference(model, engine="auto")
    assert second.engine == "openvino" and len(checks) == 1  # checked again, not skipped nor failed
    rewritten = json.loads(verdict_file.read_text())
    assert rewritten["key"] == good["key"] and Verification.from_dict(rewritten["auto"]).passed


@pytest.mark.parametrize("change", [
    lambda m: m.pop("fields"),
    lambda m: m.update(created=20261126),
    lambda m: m["fields"].update(shape=["3", 64, 64]),
    lambda m: m.update(extra="?"),
], ids=["no fields", "created a number", "shape of text", "an unknown key"])
def test_a_manifest_of_another_schema_counts_as_a_missing_entry(
        change: Callable[[dict], object], conversions: dict[str, int], caplog: pytest.LogCaptureFixture) -> None:
    build()
    entry = only_entry()
    rewrite_manifest(entry, change)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        build()
    assert conversions["onnxruntime"] == 2
    assert len(warnings(caplog, "rebuilding")) == 1
    manifest = manifest_of(only_entry())
    assert engine_cache.damage(only_entry(), manifest["key"], ("model.onnx",)) is None


def test_cache_list_escapes_what_an_entry_says(capsys: pytest.CaptureFixture[str]) -> None:
    root = engine_cache.cache_root()
    root.mkdir(parents=True, mode=0o755)
    fields = {"layout": 1, "model": "evil\x1b[2J\x1b]0;owned\x07", "weights": "ab" * 32, "engine": "onnxruntime",
              "precision": "fp32\r", "shape": [3, 64, 64], "versions": {"convnets\x9b31m": "0\n1"}}
    key = engine_cache.keys.entry_key(fields)  # a consistent entry, as a planted one would be
    entry = root / f"onnxruntime-{key[:32]}"
    entry.mkdir(mode=0o700)
    engine_cache.disk.mark(entry)  # one the cache wrote, as far as anyone can tell
    (entry / "entry.json").write_text(json.dumps({"key": key, "fields": fields, "files": {},
                                                  "created": "2026\x1b[8m"}))
    (entry / "entry.json").chmod(0o644)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "1 entry" in out
    assert all(c.isprintable() for line in out.splitlines() for c in line), repr(out)
    assert "evil\\x1b[2J\\x1b]0;owned\\x07" in out and "convnets\\x9b31m=0\\n1" in out


# --- the fill directory is private ------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_fill_directory_is_private_and_entries_are_trusted_under_any_umask(
        umask: int, monkeypatch: pytest.MonkeyPatch, conversions: dict[str, int]) -> None:
    modes = []
    counting = OnnxFormat.write  # the conversions fixture's wrapper

    def watching(self: OnnxFormat, model: object, path: Path, *args: object, **kwargs: object) -> object:
        modes.append(stat.S_IMODE(os.stat(path.parent).st_mode))
        return counting(self, model, path, *args, **kwargs)
    monkeypatch.setattr(OnnxFormat, "write", watching)
    old = os.umask(umask)
    try:
        build()
        build()  # read back: what the cache wrote under this umask is trusted
    finally:
        os.umask(old)
    assert modes == [0o700] and conversions["onnxruntime"] == 1
    entry = only_entry()
    assert not any(p.stat().st_mode & 0o022 for p in (entry, *entry.iterdir()))


# --- a bounded cache -------------------------------------------------------------------------------


def _path(model: torch.nn.Module) -> Path:
    entry = engine_cache.entry_of(model)
    assert entry is not None
    return entry.path


def _size(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.iterdir())


def test_past_the_size_limit_the_least_recently_used_entries_go(monkeypatch: pytest.MonkeyPatch,
                                                               conversions: dict[str, int]) -> None:
    zero = _path(build(0))
    monkeypatch.setenv("CONVNETS_CACHE_MAX_SIZE", str(int(_size(zero) * 2.5)))  # room for two
    one = _path(build(1))
    assert _path(build(0)) == zero and conversions["onnxruntime"] == 2  # a use of entry 0, loaded
    two = _path(build(2))
    assert entries() == sorted([zero, two])  # entry 1, the least recently used, went
    build(0)
    assert conversions["onnxruntime"] == 3 and not one.exists()


def test_eviction_removes_only_entries_the_cache_trusts(monkeypatch: pytest.MonkeyPatch) -> None:
    untrusted = _path(build(0))
    _group_writable(untrusted)
    monkeypatch.setenv("CONVNETS_CACHE_MAX_SIZE", "1")  # nothing fits: only the newest entry stays
    one = _path(build(1))
    two = _path(build(2))
    assert not one.exists() and entries() == sorted([untrusted, two])


def test_cache_list_shows_size_and_last_use_and_trim_fits_a_size(capsys: pytest.CaptureFixture[str]) -> None:
    old = _path(build(0))
    recent = _path(build(1))
    os.utime(old, (1_700_000_000, 1_700_000_000))  # last used 2023-11-14
    assert main(["cache", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:2]] == [old.name, recent.name]  # least recently used first
    assert "last used 2023-11-1" in lines[0] and f" {_size(old) / 1024:.1f} KiB " in lines[0]
    assert lines[2].startswith("2 entries") and "of at most 4.0 GiB" in lines[2]
    assert main(["cache", "trim", "--max-size", str(_size(recent) + 1)]) == 0
    assert "removed 1 least recently used engine cache entry" in capsys.readouterr().out
    assert entries() == [recent]
    with pytest.raises(SystemExit):
        main(["cache", "trim", "--max-size", "4X"])
    assert "'4X' is not a size" in capsys.readouterr().err


def test_a_size_limit_that_is_not_a_size_is_an_error_before_any_conversion(
        monkeypatch: pytest.MonkeyPatch, conversions: dict[str, int]) -> None:
    monkeypatch.setenv("CONVNETS_CACHE_MAX_SIZE", "lots")
    with pytest.raises(InvalidArgumentError, match="CONVNETS_CACHE_MAX_SIZE: 'lots' is not a size"):
        build()
    assert conversions["onnxruntime"] == 0
    assert build(cache=False) is not None  # the cache off: the limit does not matter


@pytest.mark.parametrize("text, size", [("1", 1), ("1000", 1000), ("4GiB", 4 * 1024**3), ("4G", 4 * 1024**3),
                                        ("4 GB", 4 * 1024**3), ("1.5m", 3 * 1024**2 // 2), ("2TiB", 2 * 1024**4),
                                        ("512kib", 512 * 1024), ("10B", 10)])
def test_sizes_read_as_bytes_or_with_a_binary_unit(text: str, size: int) -> None:
    assert engine_cache.parse_size(text) == size


@pytest.mark.parametrize("text", ["0", "", "-1", "4X", "GiB", "1e9", "4 GiB GiB"])
def test_what_is_not_a_size_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        engine_cache.parse_size(text)


def test_two_benchmark_runs_on_random_weights_leave_one_entry(capsys: pytest.CaptureFixture[str]) -> None:
    require_module("onnxruntime")
    args = ["benchmark", "--model", "resnet50", "--arch-kwargs", json.dumps(TINY["resnet50"]), "--engine",
            "onnxruntime", "--batch-sizes", "1", "--warmup", "1", "--iterations", "1", "--image-size", str(SIZE),
            "--device", "cpu"]
    assert main(args) == 0
    torch.rand(3)  # whatever else the process draws in between does not change the weights
    assert main(args) == 0
    assert len(entries()) == 1
