"""Every install hint works from where the user is (:func:`convnets.extras.install_hint`): from a
checkout, ``pip install -c constraints.txt -e '.[EXTRA]'``; from an installed wheel, the extra's
packages (``convnets-hub`` is not on the package index yet). None names ``convnets``: that name on the
package index belongs to another project. The distribution and its extras are read from ``setup.py``.
"""

from __future__ import annotations

import ast
import re
import shlex
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


def test_every_install_hint_names_the_distribution_or_the_checkout() -> None:
    """Literal hints name the checkout (`pip install -e '.[test]'`, the extra declared in setup.py) or
    are install_hint's own words; every other hint is made by install_hint (no literal extra hint in
    the package), and none names the taken ``convnets`` distribution."""
    name, extras = _distribution()
    for path, target in _hints():
        where = f"{path.relative_to(REPO)}: pip install {target}"
        base, _, extra = target.partition("[")
        if target.startswith("."):  # the checkout: `pip install -c constraints.txt -e '.[export]'`
            assert extra.rstrip("]") in extras | {""} or re.fullmatch(r"\{\w+\}\]", extra), where
        elif base in ("convnets", name):
            assert path == REPO / "convnets" / "extras.py", where
    bare = [f"{p.relative_to(REPO)}" for p in _source_files()
            if re.search(r"(?<![\w-])convnets\[", p.read_text(encoding="utf-8", errors="replace"))]
    assert bare == []
    # The messages that name an extra make their hint with install_hint.
    users = [p for p in _source_files() if p.suffix == ".py" and "install_hint(" in p.read_text(encoding="utf-8")]
    assert len(users) >= 9, users


def _extra_requirements(extra: str) -> list[str]:
    """setup.py's requirements of ``extra``, read with ast (independently of the installed metadata)."""
    return [r.partition(";")[0].strip() for r in ast.literal_eval(_setup_call()["extras_require"])[extra]]


def test_from_the_checkout_the_hint_installs_the_checkout(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    from convnets import extras
    from convnets.deploy.formats.base import require

    name, declared = _distribution()
    assert extras.DISTRIBUTION == name and extras.source_checkout() == REPO  # these tests run from a checkout
    assert (REPO / "constraints.txt").is_file() and "export" in declared
    monkeypatch.chdir(REPO)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    with pytest.raises(MissingDependencyError) as caught:
        require("onnxruntime", extra="export", purpose="checking")
    # pip run by this interpreter (the README's venv is never activated: a bare `pip` is the system's).
    python = shlex.quote(sys.executable)
    assert str(caught.value).endswith(f"install the 'export' extra: {python} -m pip install -c constraints.txt "
                                      "-e '.[export]'")
    monkeypatch.chdir(tmp_path)  # elsewhere: the same command, in the checkout
    assert extras.install_hint("plots") == f"cd {REPO} && {python} -m pip install -c constraints.txt -e '.[plots]'"
    # serve pins numpy<2: an environment of its own, made by this interpreter, in the checkout (as the README says).
    assert extras.install_hint("serve") == (f"cd {REPO} && {python} -m venv .venv-serve && .venv-serve/bin/python -m "
                                            "pip install -c constraints.txt -e '.[serve]'")
    assert extras.serve_convnets() == str(REPO / ".venv-serve" / "bin" / "convnets")


def test_from_an_installed_wheel_the_hint_names_the_extras_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """convnets-hub is not on the package index yet: an installed copy's hint installs what the extra
    requires, as its metadata says, which is what setup.py declares."""
    from importlib import metadata

    from convnets import extras

    name, _ = _distribution()
    monkeypatch.setattr(extras, "source_checkout", lambda: None)
    if metadata.requires(name) is None:
        pytest.skip(f"{name} is not installed here (pip install -e .)")
    python = shlex.quote(sys.executable)
    # The constraints file the wheel ships, beside the package: the checkout's (here, through the symlink).
    shipped = Path(extras.__file__).with_name("constraints.txt")
    assert shipped.read_text() == (REPO / "constraints.txt").read_text()
    constraints = f"-c {shlex.quote(str(shipped))}"
    for extra in ("export", "plots", "openvino", "explain"):
        assert extras.install_hint(extra) == f"{python} -m pip install {constraints} " + " ".join(
            f"'{r}'" for r in _extra_requirements(extra))
    serve = extras.install_hint("serve")  # the requirements in the metadata's order
    assert serve.startswith(f"{python} -m venv .venv-serve && .venv-serve/bin/python -m pip install {constraints} "
                            "path/to/convnets_hub-VERSION-py3-none-any.whl '") and " 'nvidia-pytriton>=" in serve

    def missing(dist: str) -> list[str]:
        raise metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(metadata, "requires", missing)  # no metadata at all: the extra by name
    assert extras.install_hint("plots") == f"{python} -m pip install {constraints} '{name}[plots]'"


def test_the_hints_pip_installs_into_the_environment_that_runs_convnets() -> None:
    """The hint's interpreter (its first word after any ``cd``) is an environment with this one's prefix: the
    packages go where convnets runs, activated or not."""
    import subprocess

    from convnets.extras import install_hint

    words = shlex.split(install_hint("plots").split(" && ")[-1])
    assert words[1:4] == ["-m", "pip", "install"]
    prefix = subprocess.run([words[0], "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert prefix == sys.prefix


#: What a user reads: the README, the documentation pages and the notebooks.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").glob("*.ipynb"))]
#: An install line that works as written: pip run by a named interpreter (the environment's own, activated or not),
#: with the constraints file (the versions CI installs). ``PYTHON``: the placeholder of docs/design.md.
INTERPRETERS_PIP = re.compile(r"(?:\S*bin/python3?|PYTHON) -m pip install (?P<rest>[^`\n]*)")


def _page_text(page: Path) -> str:
    """A page's text (a notebook's: its cells'), the lines of a paragraph joined (an inline command may be
    wrapped); a code block's lines kept apart."""
    import json

    text = page.read_text(encoding="utf-8")
    if page.suffix == ".ipynb":
        text = "\n\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    out, fenced = [], False
    for line in text.splitlines():
        fence = line.lstrip().startswith("```")
        fenced ^= fence
        out.append(("\n" if fenced or fence or not line.strip() else " ") + line.strip())
    return "".join(out)


def test_every_install_line_of_the_docs_and_notebooks_uses_the_interpreter_s_pip_and_the_constraints() -> None:
    """A bare ``pip install`` is whichever pip the shell finds first (the system's when the environment is not
    activated), and without ``-c constraints.txt`` it installs versions CI never ran."""
    assert len(PAGES) > 10 and any(p.suffix == ".ipynb" for p in PAGES)
    found, wrong = 0, []
    for page in PAGES:
        text = _page_text(page)
        good = {m.start("rest") - len("pip install "): m["rest"] for m in INTERPRETERS_PIP.finditer(text)}
        for m in re.finditer(r"pip3? install", text):
            found += 1
            rest = good.get(m.start())
            if rest is None or not re.match(r"(?:-\w+ )*-c \S*constraints\.txt ", rest):
                wrong.append(f"{page.relative_to(REPO)}: ...{text[max(0, m.start() - 40):m.end() + 50]}...")
    assert found >= 20 and wrong == []


def test_the_readme_lists_every_extra() -> None:
    _, extras = _distribution()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    index = (REPO / "docs" / "index.md").read_text(encoding="utf-8")
    assert [e for e in sorted(extras) if f"`[{e}]`" not in readme] == []
    assert [e for e in sorted(extras - {"docs", "test"}) if f"| `{e}` |" not in index] == []
