"""One registry shape for every pluggable kind: a name maps to a lazily imported object.

Why it exists: routing policies, eviction policies, engines and the ``kvmesh``
subcommands are each chosen by name. Each kind keeps one table, ``{"name":
("module.path", "attribute")}``, in one module of its own (e.g.
``kvmesh.routing.registry``); nothing is imported until a name is used, so the
table's module imports none of its implementations (no hidden import cycles, and
a heavy backend such as vLLM is loaded only when chosen). Adding an
implementation is its own file plus one line in its kind's table. This is the
shape of vLLM's ``KVConnectorFactory``.

The services run by ``kvmesh serve`` are not in such a table: they register under
the ``kvmesh.services`` entry-point group instead, because the tools package must
never import a service's code by name (tests/test_layout_rules.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """Names of one ``kind`` (e.g. "routing policy") mapped to ``(module, attribute)``, loaded on first use."""

    def __init__(self, kind: str, table: Mapping[str, tuple[str, str]]) -> None:
        self.kind = kind
        self._table = dict(table)
        self._loaded: dict[str, T] = {}

    def names(self) -> list[str]:
        """Every registered name, sorted (nothing is imported)."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._table)

    def location(self, name: str) -> tuple[str, str]:
        """``(module, attribute)`` of ``name``; ``ValueError`` naming the choices if unknown."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}")
        return self._table[name]

    def load(self, name: str) -> T:
        """The object registered as ``name``, importing its module the first time.

        ``ValueError`` for an unknown name; an ``ImportError`` of the module (a missing
        optional backend) propagates for the caller to explain.
        """
        module, attr = self.location(name)
        obj = self._loaded.get(name)
        if obj is None:
            obj = self._loaded[name] = getattr(importlib.import_module(module), attr)
        return obj

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``load(name)(*args, **kwargs)``: an instance of the registered class."""
        return self.load(name)(*args, **kwargs)  # type: ignore[operator]
