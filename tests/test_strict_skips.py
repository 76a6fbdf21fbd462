"""Under CI a skip for a missing test dependency fails the run; other skips stay skips. One test file runs
with pytest alone, and on parallel workers where pytest-xdist is installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from strict_skips import is_missing_dependency

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import pytest
from strict_skips import require_module

def test_needs_a_missing_package():
    pytest.importorskip("convnets_no_such_package")

def test_needs_a_missing_package_through_the_helper():
    require_module("convnets_no_such_package_either")

@pytest.mark.skipif(True, reason="needs CUDA")
def test_needs_a_gpu():
    pass

@pytest.mark.skipif(True, reason="the 'export' extra (onnx, onnxruntime) is not installed")
def test_needs_an_extra():
    pass
'''


def _run_sample(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
        "from strict_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    return done.stdout


@pytest.mark.parametrize("ci", [None, "false"])
def test_without_ci_missing_dependencies_skip(tmp_path: Path, ci: str | None) -> None:
    out = _run_sample(tmp_path, ci)
    assert "4 skipped" in out and "failed" not in out and "error" not in out


def test_under_ci_missing_dependencies_fail_and_other_skips_stay(tmp_path: Path) -> None:
    out = _run_sample(tmp_path, "true")
    assert "1 skipped" in out and "needs CUDA" in out
    # The import skips fail during the test, the skipif one during setup (an error).
    assert "2 failed" in out and "1 error" in out, out
    assert out.count("CI is set") >= 3 and "pip install -e '.[test]'" in out


@pytest.mark.parametrize("reason, missing", [
    ("could not import 'timm': No module named 'timm'", True),
    ("scikit-image is not installed (pip install -e .[test])", True),
    ("tritonclient is not installed", True),
    ("needs CUDA", False),
    ("this CPU has no native bf16 support", False),
    ("torch.compile cannot work on this machine", False),
])
def test_missing_dependency_reasons(reason: str, missing: bool) -> None:
    assert is_missing_dependency(reason) is missing


PRINT_OPTIONS = '''
import json, os, pytest

@pytest.hookimpl(tryfirst=True)  # registered before pytest-xdist and conftest: called after both
def pytest_cmdline_main(config):
    o = config.option
    with open(os.environ["OPTIONS_OUT"], "w") as f:
        json.dump([o.numprocesses, o.maxprocesses, o.dist], f)
'''


@pytest.mark.parametrize("args", [[], ["-n", "0"]])
def test_the_workers_are_asked_for_where_pytest_xdist_is(tmp_path: Path, args: list[str]) -> None:
    """`python -m pytest tests/FILE` on parallel workers, at most 4, a module per worker, as before the options
    left pyproject's addopts (conftest.py asks for them); `-n 0` still runs in one process."""
    pytest.importorskip("xdist")
    (tmp_path / "print_options.py").write_text(PRINT_OPTIONS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OPTIONS_OUT": str(tmp_path / "options.json")}
    subprocess.run([sys.executable, "-m", "pytest", "-p", "print_options", "-p", "no:cacheprovider", "--collect-only",
                    "-q", *args, str(TESTS / "test_evaluation_report.py")], capture_output=True, env=env,
                   cwd=TESTS.parent, timeout=300)
    workers, most, dist = json.loads((tmp_path / "options.json").read_text())
    if args:
        assert [workers, most, dist] == [0, None, "no"]
    else:  # a worker per CPU, and one more
        assert workers == min(len(os.sched_getaffinity(0)) + 1, 4) and [most, dist] == [4, "loadscope"]


def test_one_file_runs_with_pytest_alone() -> None:
    """Without pytest-xdist (`-p no:xdist` stands in for an environment with pytest only), pyproject's addopts
    hold no option that plain pytest would refuse."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                           str(TESTS / "test_evaluation_report.py")], capture_output=True, text=True,
                          cwd=TESTS.parent, timeout=300)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
