"""The self-contained examples (their own embedded masters, broker and celery processes), run as
a user runs them; each exits 0 only when what it shows actually happened."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, timeout: float) -> str:
    result = subprocess.run(
        [sys.executable, script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.timeout(120)
def test_long_running_job_outlives_its_ttl_and_stops_when_its_lock_is_lost() -> None:
    out = _run("examples/long_running/run.py", timeout=100)
    assert "reconciled 2026-q1 in 10 steps (5.0s under a 2.0s TTL)" in out
    assert "second job stopped before writing again: LockLost:" in out


@pytest.mark.timeout(120)
def test_beat_singleton_never_overlaps_and_survives_losing_its_leading_beat() -> None:
    out = _run("examples/beat_singleton/run.py", timeout=100)
    assert "killed the leading beat" in out
    assert ", 0 overlapping runs" in out


@pytest.mark.timeout(120)
def test_fenced_ledger_refuses_the_paused_workers_late_write() -> None:
    out = _run("examples/fenced_ledger/run.py", timeout=100)
    assert "unfenced: balance 100, expected 150 (a credit was lost)" in out
    fenced = r"^fenced: balance 150; stale write refused \(fence (\d+) < (\d+)\), retried$"
    refused = re.search(fenced, out, re.M)
    assert refused is not None, out
    assert int(refused[1]) < int(refused[2])
