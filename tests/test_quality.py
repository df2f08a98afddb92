"""The code stays formatted, ruff- and mypy-clean, and its planted bugs current: run as part of
the test command, so a change that breaks any of them fails the suite a developer runs, not only
CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["celery_redlock", "tests", "benchmarks", "examples", ".ci"]


def _run(*args: str, timeout: float) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_ruff_is_clean() -> None:
    _run("ruff", "check", *TREES, timeout=240)


@pytest.mark.timeout(300)
def test_ruff_format_is_applied() -> None:
    _run("ruff", "format", "--check", *TREES, timeout=240)


@pytest.mark.timeout(300)
def test_mypy_is_clean() -> None:
    _run("mypy", timeout=280)


@pytest.mark.timeout(300)
def test_every_planted_bug_still_applies_and_names_tests_that_exist() -> None:
    """A mutant whose text moved, or whose test was renamed or given a parameter, is not run
    (an error, not a catch): ``python -m tests.mutations.run`` would report it, but only when
    someone runs it. Its edits must match once and each test it names must be collected."""
    from tests.mutations.mutants import MUTANTS
    from tests.mutations.run import stale_reason, unknown_tests

    stale = {mutant.name: stale_reason(mutant.edits, ROOT) for mutant in MUTANTS}
    assert not {name: why for name, why in stale.items() if why}
    assert unknown_tests(list(MUTANTS), ROOT) == {}
