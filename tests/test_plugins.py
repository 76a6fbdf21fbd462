"""convnets.plugins.Registry: the one registry of engines, export formats and output formats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from convnets.errors import InvalidArgumentError
from convnets.plugins import Registry


class Shape:
    name = ""


class Square(Shape):
    name = "square"


def test_register_get_names_and_the_decorator() -> None:
    shapes: Registry[Shape] = Registry("shape", Shape)
    square = shapes.register(Square())
    assert shapes.register(Square()) is not square  # the same class again: accepted, replaces it

    @shapes.plugin
    class Circle(Shape):
        name = "circle"

    assert Circle.name == "circle" and isinstance(shapes.get("circle"), Circle)
    assert shapes.names() == ("square", "circle") and [s.name for s in shapes.all()] == ["square", "circle"]
    with pytest.raises(InvalidArgumentError, match=r"^unknown shape 'hexagon'; choose one of square, circle$"):
        shapes.get("hexagon")
    with pytest.raises(InvalidArgumentError, match=r"^unknown shape shape='x'; choose one of square, circle, any$"):
        shapes.get("x", label="shape='x'", also=("any",))
    with pytest.raises(InvalidArgumentError, match=r"a shape named 'square' is already registered \(Square\)"):
        shapes.register(type("Other", (Shape,), {"name": "square"})())
    with pytest.raises(InvalidArgumentError, match="a shape must be a Shape instance, got 'square'"):
        shapes.register("square")  # type: ignore[arg-type]


def _triangle_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, package: str, module: str) -> str:
    """A package ``package`` on the path whose module ``module`` holds a Shape named 'triangle' as ``SHAPE``,
    neither imported yet (the test forgets both at its end: :func:`_forget`). Returns the module's dotted name."""
    folder = tmp_path / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / f"{module}.py").write_text(
        "from test_plugins import Shape\nclass Triangle(Shape):\n    name = 'triangle'\nSHAPE = Triangle()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget(f"{package}.{module}")
    return f"{package}.{module}"


def _forget(module: str) -> None:
    for name in (module, module.rpartition(".")[0]):
        sys.modules.pop(name, None)


def test_built_in_modules_are_listed_without_import_and_loaded_on_first_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _triangle_package(tmp_path, monkeypatch, "fakeshapes", "triangle")
    shapes: Registry[Shape] = Registry("shape", Shape, package="fakeshapes", builtin={"triangle": "triangle"},
                                       attribute="SHAPE")
    shapes.register(Square())
    assert shapes.names() == ("triangle", "square") and module not in sys.modules
    assert shapes.get("triangle").name == "triangle" and module in sys.modules
    assert [s.name for s in shapes.all()] == ["triangle", "square"]
    _forget(module)


def test_a_built_in_plug_in_may_live_in_a_module_of_another_name(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The map says which module holds which plug-in: listing imports nothing, the first use imports the module
    named for it; a map that names a plug-in wrongly is one clear error, not a KeyError."""
    module = _triangle_package(tmp_path, monkeypatch, "moreshapes", "three_sides")
    shapes: Registry[Shape] = Registry("shape", Shape, package="moreshapes", builtin={"triangle": "three_sides"},
                                       attribute="SHAPE")
    assert shapes.names() == ("triangle",) and module not in sys.modules
    assert [s.name for s in shapes.all()] == ["triangle"] and shapes.get("triangle").name == "triangle"
    assert module in sys.modules
    wrong: Registry[Shape] = Registry("shape", Shape, package="moreshapes", builtin={"trigon": "three_sides"},
                                      attribute="SHAPE")
    with pytest.raises(InvalidArgumentError, match="the built-in shape 'trigon' of module moreshapes.three_sides "
                                                   "is named 'triangle'"):
        wrong.all()
    _forget(module)
