"""``Registry``: the named plug-ins of one interface (inference engines, export formats, output formats).

A registry maps a name to one instance of its interface. The built-in plug-ins are modules of one
package, each with an instance at a module attribute (``ENGINE``, ``FORMAT``), listed by an explicit
map of plug-in name to module name; they are imported on first use, so that listing their names
imports nothing. Other code adds a plug-in with
:meth:`Registry.register`, or :meth:`Registry.plugin` as a class decorator::

    from convnets.deploy.engines import ENGINES

    @ENGINES.plugin
    class MyEngine(Engine):
        name = "mine"
        ...

(The models' registry is :mod:`convnets.registry`, with :mod:`convnets.models.specs`: a model is an
architecture and its builder function, registered by name with its torch.hub names.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

from convnets.errors import InvalidArgumentError

__all__ = ["Registry"]

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Generic[T]):
    """Name -> instance of ``interface``; built-in ones are modules of ``package``, loaded on first use.

    Args:
        kind: what a plug-in is called in messages (``"inference engine"``).
        interface: the class every plug-in is an instance of (``T``, usually abstract); its ``name``
            attribute is its name.
        package: the package whose modules ``builtin`` names.
        builtin: each built-in plug-in's name -> the module of ``package`` that holds it, in the order
            listings show them (or a function that makes that map, called at each listing: a module
            dropped into the package is a plug-in).
        attribute: the module attribute that holds each built-in plug-in's instance.
    """

    def __init__(self, kind: str, interface: type, *, package: str = "",
                 builtin: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
                 attribute: str = "") -> None:
        self.kind = kind
        self.interface = interface
        self._package = package
        self._builtin = builtin if callable(builtin) else dict(builtin or {})
        self._attribute = attribute
        self._items: dict[str, T] = {}

    def register(self, item: T) -> T:
        """Add ``item`` under its ``name`` and return it (again for the same class: no change).

        Raises:
            InvalidArgumentError: ``item`` is not an instance of the interface, or another class has its name.
        """
        if not isinstance(item, self.interface):
            raise InvalidArgumentError(f"a {self.kind} must be a {self.interface.__name__} instance, got {item!r}")
        name: str = getattr(item, "name")
        known = self._items.get(name)
        if known is not None and type(known) is not type(item):
            raise InvalidArgumentError(f"a {self.kind} named {name!r} is already registered "
                                       f"({type(known).__qualname__})")
        self._items[name] = item
        return item

    def plugin(self, cls: C) -> C:
        """Class decorator: register an instance of ``cls`` (made without arguments) and return ``cls``."""
        self.register(cls())
        return cls

    def names(self) -> tuple[str, ...]:
        """Every plug-in's name, built-in ones first (imports none of them)."""
        return tuple(dict.fromkeys((*self._builtin_map(), *self._items)))

    def all(self) -> tuple[T, ...]:
        """Every plug-in, in :meth:`names`' order (the built-in modules imported on first use).

        Raises:
            InvalidArgumentError: a built-in module's plug-in is not named as the map says (a packaging fault).
        """
        for name, module in self._builtin_map().items():
            if name not in self._items:
                item = getattr(importlib.import_module(f"{self._package}.{module}"), self._attribute)
                if getattr(item, "name", None) != name:
                    raise InvalidArgumentError(f"the built-in {self.kind} {name!r} of module {self._package}.{module} "
                                               f"is named {getattr(item, 'name', None)!r}")
                self.register(item)
        return tuple(self._items[name] for name in self.names())

    def get(self, name: str, *, label: str | None = None, also: Iterable[str] = ()) -> T:
        """The plug-in called ``name``.

        Args:
            label: how the message shows the name the user gave (default: ``repr(name)``), e.g. ``engine='x'``.
            also: more valid choices to list (``auto``).

        Raises:
            InvalidArgumentError: no such plug-in; the message lists them.
        """
        found = next((item for item in self.all() if getattr(item, "name") == name), None)
        if found is None:
            raise InvalidArgumentError(f"unknown {self.kind} {label or repr(name)}; choose one of "
                                       f"{', '.join((*self.names(), *also))}")
        return found

    def _builtin_map(self) -> dict[str, str]:
        return dict(self._builtin() if callable(self._builtin) else self._builtin)
