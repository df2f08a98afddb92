"""The house's measures, checked on every run so they stay met: no module in the package over
600 lines, no function over cyclomatic complexity 15, and every import path the README, the
docs and the examples show still works (a module that moved keeps a thin re-export).

Import cycles, the layers and the core's freedom from Celery are tests/test_layout.py's.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "celery_redlock"
MAX_LINES = 600
MAX_COMPLEXITY = 15
# What users read: code blocks here are what they copy.
DOCUMENTS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "examples").rglob("*.py")),
]
# Paths the docs name in prose or configuration rather than in an import statement.
NAMED_PATHS = [
    "celery_redlock.lock.admin",
    "celery_redlock.beat:RedlockScheduler",
    "celery_redlock.fenced",
    "celery_redlock.testing",
    "celery_redlock.testing.pytest_plugin",
]
_CODE_BLOCK = re.compile(r"```(?:python|py|pycon)?\n(.*?)```", re.S)
_COLON_PATH = re.compile(r"\bcelery_redlock(?:\.[a-z_]+)*:[A-Za-z_]+\b")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_no_function_is_over_complexity_15() -> None:
    complex_ = {}
    for path in _modules():
        for block in cc_visit(path.read_text()):
            # Methods are visited with their classes; a class's own figure is its methods' mean.
            blocks = list(block.methods) if type(block).__name__ == "Class" else [block]
            for function in blocks:
                if function.complexity > MAX_COMPLEXITY:
                    complex_[f"{path.relative_to(ROOT)}:{function.lineno} {function.fullname}"] = (
                        function.complexity
                    )
    assert complex_ == {}, f"functions over complexity {MAX_COMPLEXITY}: {complex_}"


def _python_sources(path: Path) -> list[str]:
    text = path.read_text()
    return [text] if path.suffix == ".py" else _CODE_BLOCK.findall(text)


def documented_paths() -> set[tuple[str, str]]:
    """(module, name) for every import of the package the documents show; name "" for the
    module itself."""
    found: set[tuple[str, str]] = set()
    for path in DOCUMENTS:
        for source in _python_sources(path):
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue  # shell sessions, fragments: their imports are read line by line below
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("celery_redlock"):
                    found.update((node.module or "", alias.name) for alias in node.names)
                elif isinstance(node, ast.Import):
                    found.update((a.name, "") for a in node.names if a.name.startswith("celery_redlock"))
        for match in _COLON_PATH.findall(path.read_text()):
            module, _, name = match.partition(":")
            found.add((module, name))
    for named in NAMED_PATHS:
        module, _, name = named.partition(":")
        found.add((module, name))
    # The entry points (the `celery redlock` command); pyproject.toml is read as text, since
    # tomllib is not in every Python this package supports.
    for target in re.findall(
        r'^\w+ = "(celery_redlock[\w.]*:\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M
    ):
        module, _, name = target.partition(":")
        found.add((module, name))
    return found


_CHECK = """
import importlib, json, sys
missing = []
for module, name in json.loads(sys.argv[1]):
    try:
        loaded = importlib.import_module(module)
        if name:
            getattr(loaded, name)
    except Exception as exc:
        missing.append(f"{module}{':' + name if name else ''}: {type(exc).__name__}: {exc}")
print(json.dumps(missing))
"""


@pytest.mark.timeout(60)
def test_every_documented_import_path_still_works() -> None:
    paths = sorted(documented_paths())
    # More than the handful named above: the documents' own imports were found.
    assert len(paths) > len(NAMED_PATHS) + 5, paths
    # A fresh interpreter: this one has long since imported everything.
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, json.dumps(paths)],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        check=True,
    )
    assert json.loads(done.stdout) == [], "documented import paths that fail"
