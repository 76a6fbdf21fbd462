"""The package type-checks, and what type checkers see of the generated builders matches the registry.

``python -m mypy`` reads its configuration (files, strictness, the untyped third-party packages) from
``pyproject.toml``. The builders (``convnets.resnet50``, ...) are explicit functions in ``convnets/builders.py``; the
torch.hub entry points (``nvidia_*``) are generated at run time from them and
:data:`convnets.models.specs.MODELS`, and ``hubconf.py`` declares them to type checkers as builders.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from convnets.models.specs import MODELS
from strict_skips import require_module

REPO = Path(__file__).resolve().parents[1]



@pytest.mark.slow
def test_mypy_is_clean() -> None:
    require_module("mypy")  # under CI (CI=true) a missing mypy is a failure, not a skip
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.fail(f"python -m mypy (configured in pyproject.toml) exited {result.returncode}:\n{output}",
                    pytrace=False)


def test_every_registered_model_has_one_explicit_builder() -> None:
    """convnets.builders defines one function per registered model, named after it and listed in its
    literal ``__all__`` (what ``convnets/__init__.py`` hands type checkers with ``import *``)."""
    tree = ast.parse((REPO / "convnets" / "builders.py").read_text(encoding="utf-8"))
    defined = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
               and any(ast.unparse(d) == "builder" for d in node.decorator_list)]
    exported = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and ast.unparse(node.targets[0]) == "__all__")
    assert sorted(defined) == sorted(exported) == sorted(MODELS), (
        f"convnets/builders.py: @builder functions {sorted(defined)}, __all__ {sorted(exported)}, "
        f"registered models {sorted(MODELS)}: add `@builder def NAME(...)` and its name in __all__")


@pytest.mark.slow
def test_type_checkers_see_what_the_builders_return(tmp_path: Path) -> None:
    """A classifier by default, the backbone with ``features_only=True``: through the builders, the
    hub entry points and get_model (registry.Builder's overloads)."""
    require_module("mypy")
    snippet = tmp_path / "uses.py"
    snippet.write_text(
        "from typing_extensions import assert_type\n"
        "import convnets, hubconf\n"
        "from convnets.models.features import ResNetFeatures\n"
        "from convnets.models.resnet import ResNet\n"
        "assert_type(convnets.resnet50(), ResNet)\n"
        "assert_type(convnets.resnext101_32x4d(True, features_only=True), ResNetFeatures)\n"
        "assert_type(hubconf.nvidia_resneXt(features_only=True), ResNetFeatures)\n"
        "assert_type(convnets.get_model('resnet50', features_only=False), ResNet)\n"
        "assert_type(convnets.get_model('resnet50', features_only=True, out_indices=(2, 3)), ResNetFeatures)\n")
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                             str(snippet)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
