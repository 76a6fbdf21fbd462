"""Under CI, a test skipped for a missing dependency fails instead (a pytest plugin).

CI installs every test dependency (``pip install -e .[test]``), so there a skip such as
``pytest.importorskip("timm")`` or ``skipif(find_spec("onnx") is None)`` means a broken
environment, and ~60 tests would silently stop running. With the environment variable ``CI`` set
(``CI=true``; ``.ci/run`` sets it), such skips are reported as failures. Skips for anything else
(no CUDA GPU, no native bf16, ...) stay skips.

A skip counts as "missing dependency" when its reason says so the way ``pytest.importorskip`` and
this suite's guards spell it: ``could not import ...``, ``No module named ...`` or
``... is not installed``. Write new dependency skips in one of these forms (or use
:func:`require_module`). DALI ships wheels for Linux x86-64 only (see setup.py's ``test`` extra),
so elsewhere a missing DALI stays a skip.

``tests/conftest.py`` imports the hooks from here, which registers them.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Generator
from types import ModuleType
from typing import Any

import pytest

_MISSING = re.compile(r"could not import|no module named|is not installed", re.IGNORECASE)


def ci_is_strict() -> bool:
    """Whether the ``CI`` environment variable is set to something other than a false value."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def _dali_is_optional_here() -> bool:
    return not (platform.system() == "Linux" and platform.machine() == "x86_64")


def is_missing_dependency(reason: str) -> bool:
    """Whether a skip reason says that a test dependency is not installed (and CI must have it)."""
    if not _MISSING.search(reason):
        return False
    return not ("dali" in reason.lower() and _dali_is_optional_here())


def require_module(name: str, *, extra: str = "test") -> ModuleType:
    """``pytest.importorskip(name)``, with a message that names the pip extra; fails under CI."""
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install -e .[{extra}])")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail_if_missing_dependency(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or not ci_is_strict():
        return
    reason = _skip_reason(report)
    if is_missing_dependency(reason):
        report.outcome = "failed"
        report.longrepr = (f"CI is set, and CI installs every test dependency, so this skip is a failure: "
                           f"{reason} (install them with: pip install -e '.[test]')")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    _fail_if_missing_dependency(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    # A module-level importorskip skips the whole module at collection time.
    outcome = yield
    _fail_if_missing_dependency(outcome.get_result())
