"""convnets.machine: bf16 against fp32 measured on this CPU, once per CPU model and library version."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from convnets import machine


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An engine cache of this test's own, in a process that has measured nothing yet."""
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(tmp_path / "engines"))
    machine.cpu_bf16_speedup.cache_clear()
    yield tmp_path / "engines"
    machine.cpu_bf16_speedup.cache_clear()


def _count_measurements(monkeypatch: pytest.MonkeyPatch, result: float) -> list[float]:
    calls: list[float] = []

    def measure() -> float:
        calls.append(result)
        return result
    monkeypatch.setattr(machine, "_measure", measure)
    return calls


def test_the_real_measurement_is_a_positive_ratio_and_the_advice_follows_it(cache: Path) -> None:
    """On whatever CPU this runs: a ratio of two real timings, kept for the next process, and the advice is that
    number's (bf16 slower exactly where it is below 1)."""
    speedup = machine.cpu_bf16_speedup()
    assert math.isfinite(speedup) and speedup > 0
    assert machine.bf16_slower_than_fp32() is (speedup < 1.0)
    (entry,) = json.loads((cache / machine.MEASURED).read_text()).values()
    assert entry["bf16_speedup"] == speedup


def test_measured_once_per_cpu_and_versions_then_read_back(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_measurements(monkeypatch, 0.61)
    assert machine.cpu_bf16_speedup() == 0.61 and machine.cpu_bf16_speedup() == 0.61
    machine.cpu_bf16_speedup.cache_clear()  # a new process: reads the file
    assert machine.cpu_bf16_speedup() == 0.61 and calls == [0.61]
    (key,) = json.loads((cache / machine.MEASURED).read_text())
    import torch

    assert f"torch {torch.__version__}" in key and f"convnets {machine.VERSION}" in key
    # Another PyTorch: measured again, kept beside the first.
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    machine.cpu_bf16_speedup.cache_clear()
    calls = _count_measurements(monkeypatch, 2.5)
    assert machine.cpu_bf16_speedup() == 2.5 and calls == [2.5]
    assert len(json.loads((cache / machine.MEASURED).read_text())) == 2
    assert (cache / machine.MEASURED).stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("kind", ["a link", "not JSON", "a list", "a negative ratio"])
def test_a_file_it_cannot_trust_is_measured_again(kind: str, cache: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    key = machine._key()
    cache.mkdir()
    path = cache / machine.MEASURED
    if kind == "a link":  # someone else's numbers, through a link: not read, and not written through
        planted = tmp_path / "planted.json"
        planted.write_text(json.dumps({key: {"bf16_speedup": 9.0, "measured": 0}}))
        path.symlink_to(planted)
    else:
        path.write_text({"not JSON": "{", "a list": "[]",
                         "a negative ratio": json.dumps({key: {"bf16_speedup": -1.0}})}[kind])
    calls = _count_measurements(monkeypatch, 1.7)
    assert machine.cpu_bf16_speedup() == 1.7 and calls == [1.7]
    if kind == "a link":
        assert json.loads((tmp_path / "planted.json").read_text())[key]["bf16_speedup"] == 9.0
    assert not path.is_symlink() and json.loads(path.read_text())[key]["bf16_speedup"] == 1.7


def test_a_cache_that_cannot_be_written_still_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(blocker / "engines"))  # its parent is a file
    machine.cpu_bf16_speedup.cache_clear()
    try:
        _count_measurements(monkeypatch, 0.8)
        assert machine.cpu_bf16_speedup() == 0.8 and machine.bf16_slower_than_fp32()
    finally:
        machine.cpu_bf16_speedup.cache_clear()
