"""The house (issues 11, 29): which part of ``shared_svc`` may import which, read with ``ast``.

docs/architecture.md's "Layers" table names every part of the package (each top-level
package and module) and what of ``shared_svc`` it may import; this test checks the code
against it, and the table itself:

- every part is a row, and each part imports only what its row allows;
- no arrow runs back up: the table's arrows form no circle, so neither do the parts';
- no import circle among the modules themselves (a package inside: the Services and
  upgrade controllers' modules too);
- the pure cores (``reconcile/``, ``upgrade/``) import no I/O library;
- both controllers run on the one runtime;
- no two modules share a file name in different roles: a name repeats only between twins,
  at the same place in the two controller packages or in the two pure cores;
- no asyncio task is started outside the Manager and the controller runtime (but where a
  call awaits the tasks it starts before it returns: :data:`AWAITED_TASKS`);
- no module of ``shared_svc`` is over 600 lines, no class over 250, no function over 60
  (issues 21, 45).

Every import counts: inside functions and ``TYPE_CHECKING`` blocks too.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shared_svc"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

IO_LIBRARIES = ("aiohttp", "kubernetes_asyncio", "prometheus_client")
PURE_CORES = ("reconcile", "upgrade")
# Twins: packages whose modules of one name have one role in each.
TWINS = (("controllers", "services"), ("controllers", "upgrade")), (("reconcile",), ("upgrade",))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(PACKAGE.rglob("*.py"))
NAMES = {module_name(p) for p in MODULES}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved; ``from a import b`` counts
    as ``a``, and as ``a.b`` too, as ``b`` may be a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def module_imports(path: Path) -> set[str]:
    """The modules of ``shared_svc`` that ``path`` imports, each as the module it is (a
    name imported from a module is that module, a submodule imported from a package is
    the submodule)."""
    own = module_name(path)
    return {m for m in imports_of(path) if m in NAMES and m != own}


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def part_of(module: str) -> str:
    """The part of the house a module belongs to: its top-level package (``kube/``), or
    the top-level module itself (``service``); the package's own ``__init__`` is
    ``__init__``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1] + "/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def modules_under(*parts: str) -> list[Path]:
    return [p for p in MODULES if p.relative_to(PACKAGE).parts[: len(parts)] == parts]


def layer_table() -> dict[str, set[str]]:
    """docs/architecture.md's "Layers" table: part -> the parts it may import."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rows[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[2]))
    return rows


def circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_layers_are_found() -> None:
    """The test reads real modules (a moved package would otherwise pass unnoticed)."""
    assert {p.stem for p in modules_under("k8s")} >= {"objects", "selectors", "events"}
    assert {p.stem for p in modules_under("reconcile")} >= {"planner", "selection", "fight"}
    assert {p.stem for p in modules_under("upgrade")} >= {"planner", "gate", "consumers"}
    assert {p.stem for p in modules_under("wait")} >= {"loop", "ratelimit", "runnable"}
    assert {p.stem for p in modules_under("runtime")} >= {"controller", "manager", "source"}
    assert {p.stem for p in modules_under("kube")} >= {
        "reflector",
        "store",
        "registry",
        "untrusted",
        "writer",
        "recorder",
        "resources",
    }
    for twin in ("services", "upgrade"):
        assert {p.stem for p in modules_under("controllers", twin)} >= {
            "caches",
            "reconciler",
            "executor",
            "status",
            "metrics",
        }


def test_the_architecture_table_names_every_part_of_the_package() -> None:
    assert set(layer_table()) == {part_of(m) for m in NAMES}


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_each_part_imports_only_what_the_architecture_table_allows(path: Path) -> None:
    part = part_of(module_name(path))
    allowed = layer_table()[part] | {part}
    outside = sorted(m for m in module_imports(path) if part_of(m) not in allowed)
    assert not outside, f"{module_name(path)} ({part}) imports {outside}"


def test_no_arrow_runs_back_up_the_table_has_no_circle() -> None:
    table = layer_table()
    assert all(set(allowed) <= set(table) for allowed in table.values()), table
    assert circles(table) == []


def test_no_import_circle_among_the_modules() -> None:
    graph = {module_name(p): module_imports(p) for p in MODULES}
    assert circles(graph) == []


def test_no_import_circle_in_the_test_environment_nor_the_tests_helpers() -> None:
    """Issue 45: none among the modules of ``testenv/``, ``tests/`` and ``proptests/``
    either (the demo's three modules imported each other; what they share is
    ``testenv/demo_parts.py``; ``testenv.builds`` imported the package's error, the
    package imports ``builds``: the caller passes its error). Imports inside functions
    count too."""
    root = PACKAGE.parent
    paths = [p for d in ("testenv", "tests", "proptests") for p in sorted((root / d).rglob("*.py"))]
    names = {module_name(p) for p in paths}
    graph = {
        module_name(p): {m for m in imports_of(p) if m in names and m != module_name(p)}
        for p in paths
    }
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("path", [p for c in PURE_CORES for p in modules_under(c)], ids=module_name)
def test_pure_cores_import_no_io(path: Path) -> None:
    io = sorted(m for m in imports_of(path) if any(within(m, lib) for lib in IO_LIBRARIES))
    assert not io, f"{module_name(path)} (a pure core) imports {io}"


@pytest.mark.parametrize("twin", ["services", "upgrade"])
def test_both_controllers_run_on_the_one_runtime(twin: str) -> None:
    path = PACKAGE / "controllers" / twin / "reconciler.py"
    assert "shared_svc.runtime.controller" in module_imports(path), path


def calls(path: Path, name: str) -> bool:
    """Does the module call ``name`` (a name, or an attribute of that name)?"""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called == name:
                return True
    return False


def test_the_runtime_makes_every_controller_from_its_reconciler() -> None:
    """Issue 45: a reconciler is ``reconcile(key) -> Result`` and what it reads; the
    runtime's Controller is made from it by ``controller_for`` alone, so no reconciler
    holds a Controller to forward calls to."""
    makers = sorted(module_name(p) for p in MODULES if calls(p, "Controller"))
    assert makers == ["shared_svc.runtime.controller"]
    builders = sorted(module_name(p) for p in MODULES if calls(p, "controller_for"))
    assert builders == ["shared_svc.service"]


def writes_not_through_the_writer(path: Path) -> list[str]:
    """Write requests a class of ``path`` sends itself (``raw_request`` with a method that
    is not GET, or ``delete_with_preconditions``), not through ``kube.writer.Writer``."""
    found = []
    for cls in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            method = node.args[1] if len(node.args) > 1 else None
            reads = isinstance(method, ast.Constant) and method.value == "GET"
            if node.func.id == "delete_with_preconditions" or (
                node.func.id == "raw_request" and not reads
            ):
                found.append(f"{cls.name}:{node.lineno}")
    return found


def test_both_controllers_write_through_the_one_writer() -> None:
    """Issue 45: one transport (``kube/writer.py``'s Writer: the bucket, the count) for the
    writes of both controllers; no controller class sends a write of its own."""
    found = {
        module_name(p): w
        for p in modules_under("controllers")
        if (w := writes_not_through_the_writer(p))
    }
    assert found == {}


def twin_place(path: Path) -> tuple[int, tuple[str, ...]] | None:
    """(twin group, place inside the twin) of a module of a twin package, else None."""
    rel = path.relative_to(PACKAGE).parts
    for group, packages in enumerate(TWINS):
        for package in packages:
            if rel[: len(package)] == package and len(rel) > len(package):
                return group, rel[len(package) :]
    return None


def repeated_names(paths: Iterable[Path]) -> dict[str, list[str]]:
    """File names that repeat outside twins (at one place in each of a twin group)."""
    by_name: dict[str, list[Path]] = defaultdict(list)
    for path in paths:
        if path.name != "__init__.py":
            by_name[path.name].append(path)
    repeated = {}
    for name, found in by_name.items():
        places = {twin_place(p) for p in found}
        if len(found) > 1 and (None in places or len(places) > 1):
            repeated[name] = sorted(str(p.relative_to(PACKAGE)) for p in found)
    return repeated


def test_no_two_modules_share_a_file_name_in_different_roles() -> None:
    assert repeated_names(MODULES) == {}


def test_a_repeated_name_outside_twins_is_found() -> None:
    found = repeated_names(
        [
            PACKAGE / "controllers" / "services" / "executor.py",
            PACKAGE / "controllers" / "upgrade" / "executor.py",  # twins: one role
            PACKAGE / "reconcile" / "planner.py",
            PACKAGE / "upgrade" / "planner.py",  # the two cores: twins
            PACKAGE / "k8s" / "events.py",
            PACKAGE / "kube" / "events.py",  # two roles
            PACKAGE / "runtime" / "metrics.py",
            PACKAGE / "controllers" / "upgrade" / "metrics.py",  # not twins
        ]
    )
    assert found == {
        "events.py": ["k8s/events.py", "kube/events.py"],
        "metrics.py": ["controllers/upgrade/metrics.py", "runtime/metrics.py"],
    }


# Where a task is started outside the runtime, and why it is no root task: each is
# awaited before the call that starts it returns (or it is the Manager itself).
AWAITED_TASKS = {
    "admission/guard.py": "AdmissionGuard.stop awaits its own Manager (Manager.start)",
    "wait/loop.py": "the waiters of one wait (stop, wake), cancelled when it ends",
    "kube/reflector.py": "one watch raced against stop, within one round of the cache",
    "kube/union.py": "the union's parts' list+watches, within its run",
    "controllers/upgrade/executor.py": "one node's evictions at once, within its pass",
}
TASK_CALLS = {"ensure_future", "create_task", "gather", "TaskGroup", "run_coroutine_threadsafe"}


def starts_tasks(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in TASK_CALLS:
                return True
    return False


def test_no_task_is_started_outside_the_manager_and_the_runtime() -> None:
    starting = {
        str(p.relative_to(PACKAGE))
        for p in MODULES
        if p.relative_to(PACKAGE).parts[0] != "runtime" and starts_tasks(p)
    }
    assert starting == set(AWAITED_TASKS)


MAX_FILE_LINES = 600


def test_no_module_of_shared_svc_is_over_600_lines() -> None:
    """Issue 45: each room split by concept (upgrade/planner.py, commands/plan/manifests.py
    and commands/upgrade.py were 1,001, 1,025 and 645 lines)."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60


def test_no_class_of_shared_svc_is_over_250_lines_nor_a_function_over_60() -> None:
    """Issues 21 and 45: each part split by concern (the Services and upgrade shells, the
    reflector and its store, the Services planner and its writes' Events). Lines from the
    ``def``/``class`` line to the last, decorators not counted."""
    too_long = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    relative = path.relative_to(PACKAGE.parent)
                    too_long.append(f"{relative}:{node.lineno} {node.name} ({length} lines)")
    assert too_long == []
