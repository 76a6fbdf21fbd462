"""The package type-checks, and what type checkers see of the generated builders matches the registry.

``python -m mypy`` reads its configuration (files, strictness, the untyped third-party packages) from
``pyproject.toml``. The builders (``convnets.resnet50``, ...) and the torch.hub entry points
(``nvidia_*``) are generated at run time from :data:`convnets.models.specs.MODELS`; type checkers
see the declarations under ``if TYPE_CHECKING:`` in ``convnets/registry.py`` and ``hubconf.py``,
and the tests below keep those in step with the registry.
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


def _type_checking_block(path: Path) -> list[ast.stmt]:
    """The statements under the module's last ``if TYPE_CHECKING:`` / ``if _TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    blocks = [node.body for node in tree.body if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
              and node.test.id in ("TYPE_CHECKING", "_TYPE_CHECKING")]
    assert blocks, f"{path.name} has no `if TYPE_CHECKING:` block"
    return blocks[-1]


def test_registry_declares_every_builder() -> None:
    block = _type_checking_block(REPO / "convnets" / "registry.py")
    declared = {node.target.id: ast.unparse(node) for node in block
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    wanted = {name: f"{name}: Builder" for name in MODELS}
    missing = [line for name, line in wanted.items() if declared.get(name) != ast.unparse(ast.parse(line))]
    extra = sorted(set(declared) - set(wanted))
    assert not missing and not extra, (
        "convnets/registry.py's `if TYPE_CHECKING:` block must declare one builder per registered model, "
        "for type checkers. " + (f"Paste into it:\n    " + "\n    ".join(missing) + "\n" if missing else "")
        + (f"Remove the declarations of {extra} (no such model is registered)." if extra else ""))


@pytest.mark.slow
def test_type_checkers_see_what_the_builders_return(tmp_path: Path) -> None:
    """A classifier by default, the backbone with ``features_only=True``: through the builders, the
    hub entry points and get_model (the declarations above and registry.Builder's overloads)."""
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


def test_hubconf_declares_every_entry_point() -> None:
    block = _type_checking_block(REPO / "hubconf.py")
    declared = {alias.asname: f"from {node.module} import {alias.name} as {alias.asname}"
                for node in block if isinstance(node, ast.ImportFrom) for alias in node.names}
    wanted = {hub: f"from convnets.registry import {info.name} as {hub}"
              for info in MODELS.values() for hub in info.hub_names}
    missing = [line for hub, line in wanted.items() if declared.get(hub) != line]
    extra = sorted(set(declared) - set(wanted))
    assert not missing and not extra, (
        "hubconf.py's `if _TYPE_CHECKING:` block at the end must declare each torch.hub entry point as its "
        "model's builder, for type checkers. " + (f"Paste into it:\n    " + "\n    ".join(missing) + "\n"
                                                 if missing else "")
        + (f"Remove the declarations of {extra} (no registered model has that hub name)." if extra else ""))


def test_package_exports_every_builder_to_type_checkers() -> None:
    block = _type_checking_block(REPO / "convnets" / "__init__.py")
    imported = {alias.name for node in block if isinstance(node, ast.ImportFrom)
                and node.module == "convnets.registry" for alias in node.names}
    missing = sorted(set(MODELS) - imported)
    assert not missing, (f"convnets/__init__.py's `if TYPE_CHECKING:` block must import the builders "
                         f"{missing} from convnets.registry (so that `convnets.{missing[0]}` is typed)")
