"""The short fault run, part of the normal test command: every scenario for a few seconds.

``FAULTS_SECONDS`` (default 11) sets each scenario's length and ``FAULTS_SEED`` (default 7) the
seed; the long run with the figures table is ``python -m tests.faults.run`` (see ``run.py``).
"""

from __future__ import annotations

import os
import shutil

import pytest

from .run import details
from .scenarios import SCENARIOS, Scenario, run_scenario

SECONDS = float(os.environ.get("FAULTS_SECONDS", "11"))
SEED = int(os.environ.get("FAULTS_SEED", "7"))


@pytest.mark.timeout(SECONDS + 90)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario(scenario: Scenario) -> None:
    if (scenario.cluster.clock_rates or scenario.cluster.clock_offsets) and shutil.which("faketime") is None:
        pytest.skip("needs Debian's faketime (apt-get install faketime; .ci/run installs it)")
    result = run_scenario(scenario, SECONDS, SEED)
    assert not result.problems(), details(result)
    if scenario.expect == "violation":
        # The register shows what the overlap cost, so the checker's finding is not an artefact.
        assert result.report.overlaps
