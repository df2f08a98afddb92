"""The short fault run, part of the normal test command: every scenario for a few seconds.

Each scenario runs for ``4 + 4 x`` its lock TTL (6 s at 0.5 s, 8 s at 1 s, 12 s at 2 s): its
faults come and go in units of the TTL, and the last two TTLs are fault-free, for the recovery
its checker asks for. ``FAULTS_SECONDS`` sets one length for all, ``FAULTS_SEED`` (default 7)
the seed; the long run with the figures table is ``python -m tests.faults.run`` (see ``run.py``).
"""

from __future__ import annotations

import os
import shutil

import pytest

from .run import details
from .scenarios import SCENARIOS, Scenario, run_scenario

SECONDS = float(os.environ["FAULTS_SECONDS"]) if os.environ.get("FAULTS_SECONDS") else None
SEED = int(os.environ.get("FAULTS_SEED", "7"))


def length(scenario: Scenario) -> float:
    """How long the short run runs ``scenario`` (see the module docstring)."""
    return SECONDS if SECONDS is not None else 4 + 4 * scenario.ttl


@pytest.mark.timeout((SECONDS or 12) + 90)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario(scenario: Scenario) -> None:
    if (scenario.cluster.clock_rates or scenario.cluster.clock_offsets) and shutil.which("faketime") is None:
        if os.environ.get("CELERY_REDLOCK_REQUIRE_FAKETIME") == "1":
            pytest.fail("faketime is required (CELERY_REDLOCK_REQUIRE_FAKETIME=1) but not on PATH")
        pytest.skip("needs Debian's faketime (apt-get install faketime; .ci/run installs it)")
    result = run_scenario(scenario, length(scenario), SEED)
    assert not result.problems(), details(result)
    if scenario.expect == "violation":
        # The register shows what the overlap cost, so the checker's finding is not an artefact.
        assert result.report.overlaps
