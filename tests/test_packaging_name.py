"""Every install hint names this project's distribution, ``convnets-hub``.

The name ``convnets`` on the package index belongs to another project: ``pip install
'convnets[export]'`` would install that one. The distribution name is read from ``setup.py``, so a
rename there fails here until every hint follows.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO

from convnets.errors import MissingDependencyError

#: Where hints live: the packages, the hub entry point, CI and the benchmarks.
SOURCES = [REPO / "convnets", REPO / "processing_utils", REPO / "hubconf.py", REPO / ".ci", REPO / "benchmarks"]
#: ``pip install [-e] TARGET``, the target with its quotes removed.
HINT = re.compile(r"pip install\s+(?:-[a-zA-Z]+\s+)*['\"]?([^\s'\")]+)")


def _setup_call() -> dict[str, ast.expr]:
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    return {kw.arg: kw.value for kw in call.keywords if kw.arg}


def _distribution() -> tuple[str, set[str]]:
    """The distribution name and its extras, as setup.py declares them."""
    keywords = _setup_call()
    return ast.literal_eval(keywords["name"]), set(ast.literal_eval(keywords["extras_require"]))


def _source_files() -> list[Path]:
    files: list[Path] = []
    for source in SOURCES:
        if source.is_file():
            files.append(source)
        elif source.is_dir():
            files += [p for p in sorted(source.rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".txt", "")
                      and "__pycache__" not in p.parts]
    return files


def _hints() -> list[tuple[Path, str]]:
    return [(path, m.group(1)) for path in _source_files()
            for m in HINT.finditer(path.read_text(encoding="utf-8", errors="replace"))]


def test_the_distribution_is_not_the_taken_name() -> None:
    name, _ = _distribution()
    assert name == "convnets-hub"
    assert ast.literal_eval(_setup_call()["license_files"]) == ["LICENSE"] and (REPO / "LICENSE").is_file()


def test_every_install_hint_names_the_distribution() -> None:
    name, extras = _distribution()
    ours = []
    for path, target in _hints():
        where = f"{path.relative_to(REPO)}: pip install {target}"
        base, _, extra = target.partition("[")
        if target.startswith("."):  # an editable install of the checkout: `pip install -e '.[test]'`
            assert extra.rstrip("]") in extras | {""}, where
        elif base in ("convnets", name):
            assert base == name, where
            # A literal extra must exist; an f-string's {extra} is checked by the message test below.
            extra = extra.rstrip("]")
            assert extra in extras or re.fullmatch(r"\{\w+\}", extra), where
            ours.append(where)
    # The export extra (the formats' MissingDependencyError) and the DALI backend at least.
    assert len(ours) >= 2, ours
    bare = [f"{p.relative_to(REPO)}" for p in _source_files()
            if re.search(r"(?<![\w-])convnets\[", p.read_text(encoding="utf-8", errors="replace"))]
    assert bare == []


def test_missing_dependency_message_installs_this_project(monkeypatch: pytest.MonkeyPatch) -> None:
    from convnets.deploy.formats.base import require

    name, _ = _distribution()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(MissingDependencyError) as caught:
        require("onnxruntime", extra="export", purpose="checking")
    assert f"pip install '{name}[export]'" in str(caught.value)
