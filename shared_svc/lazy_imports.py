"""kubernetes_asyncio's packages, their names imported as they are used (PEP 562).

``import kubernetes_asyncio`` runs ``client/__init__``, which imports every API class and
``client/models/__init__``, which imports every model: 840 and 700 modules, 38 MiB of
the 93 MiB an idle ``shared-svc run`` held, most of the 150 MiB budget of a 5,000-node
fleet (issue 22). shared-svc sends its requests itself (``kube.writer.request``) and uses
a handful of those names.

:func:`install` (``shared_svc/__init__``) puts a finder before the others on
``sys.meta_path``; it imports nothing until kubernetes_asyncio is imported. Then each of
the :data:`LAZY` packages becomes a module whose names are those its ``__init__`` binds,
each imported from its submodule on first use (``from kubernetes_asyncio.client import
ApiClient`` imports ``client.api_client`` alone). The names and constants are read from
the ``__init__``'s text (``ast``): an ``__init__`` that does anything else than import
names and assign constants is imported as it is (a new version is never half-loaded).
Where kubernetes_asyncio was imported before shared_svc, nothing changes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

LAZY = ("kubernetes_asyncio", "kubernetes_asyncio.client", "kubernetes_asyncio.client.models")


def bindings(source: str, package: str) -> tuple[dict[str, tuple[str, str]], dict[str, Any]] | None:
    """What an ``__init__`` binds: names -> (module, attribute; "" for the module itself),
    and constants; None when it does anything else."""
    names: dict[str, tuple[str, str]] = {}
    constants: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "__future__":
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith(package + "."):
                return None
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(package + ".") or not alias.asname:
                    return None
                names[alias.asname] = (alias.name, "")
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None
            for target in node.targets:
                constants[target.id] = value  # type: ignore[attr-defined]
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        else:
            return None
    return names, constants


class _LazyLoader(importlib.abc.Loader):
    def __init__(
        self,
        real: importlib.machinery.ModuleSpec,
        names: dict[str, tuple[str, str]],
        constants: dict[str, Any],
    ) -> None:
        self._real, self._names, self._constants = real, names, constants

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__.update(self._constants)
        module.__file__ = self._real.origin
        names = self._names

        def __getattr__(name: str) -> Any:
            if name not in names:
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            source, attribute = names[name]
            value = importlib.import_module(source)
            if attribute:
                value = getattr(value, attribute)
            setattr(module, name, value)
            return value

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


class _LazyFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in LAZY:
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or real.origin is None or real.submodule_search_locations is None:
            return None
        try:
            with open(real.origin, encoding="utf-8") as fh:
                found = bindings(fh.read(), fullname)
        except (OSError, SyntaxError, UnicodeDecodeError):
            found = None
        if found is None:
            return None  # imported as it is
        spec = importlib.util.spec_from_loader(
            fullname, _LazyLoader(real, *found), origin=real.origin, is_package=True
        )
        if spec is None:
            return None
        spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


_FINDER = _LazyFinder()


def install() -> None:
    """Once per process; after kubernetes_asyncio was imported it changes nothing."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
