"""Generated workloads on real workers, each example judged by the progress checker.

Each example is a mix of chains, groups, chords, sequential ``delay().get()`` and bursts of
``delay()`` on one to three keys, each item in one of the modes (retry, skip, fail, wait), run
on the prefork or the threads worker; every task it publishes must end in exactly one allowed
way (see ``checker.py``). The workers are the package's, shared by every example; each example
uses keys of its own.

``CELERY_REDLOCK_PROGRESS_EXAMPLES`` sets the number of examples (default 80: about 30 s on two
idle cores, a few hundred ms each); ``CELERY_REDLOCK_PROGRESS_SEED`` fixes the seed (otherwise
hypothesis draws one and prints it on failure). Shrinking is off: each step would replay a
timing-dependent workload on real workers; the failing example is reported, with the checker's
findings, as it ran.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

from celery_redlock.testing import CeleryWorker

from .harness import Workload
from .progressapp import MODES
from .test_scenarios import explain

EXAMPLES = int(os.environ.get("CELERY_REDLOCK_PROGRESS_EXAMPLES") or 80)
SEED = os.environ.get("CELERY_REDLOCK_PROGRESS_SEED")
KINDS = ("chain", "group", "chord", "sequential", "burst")
SECONDS = (0.0, 0.0, 0.02, 0.1)

Workers = dict[str, tuple[str, list[CeleryWorker]]]


@dataclass(frozen=True)
class Item:
    kind: str
    mode: str
    keys: tuple[int, ...]
    seconds: tuple[float, ...]

    def __str__(self) -> str:
        return f"{self.kind}/{self.mode} keys {list(self.keys)} seconds {list(self.seconds)}"


@st.composite
def items(draw: st.DrawFn, keys: int) -> Item:
    kind = draw(st.sampled_from(KINDS))
    size = draw(st.integers(2, 8 if kind == "sequential" else 6))
    names = st.integers(0, keys - 1)
    return Item(
        kind,
        draw(st.sampled_from(MODES)),
        tuple(draw(st.lists(names, min_size=size, max_size=size))),
        tuple(draw(st.lists(st.sampled_from(SECONDS), min_size=size, max_size=size))),
    )


@st.composite
def workloads(draw: st.DrawFn) -> tuple[str, list[Item]]:
    keys = draw(st.integers(1, 3))
    return draw(st.sampled_from(["prefork", "threads"])), draw(st.lists(items(keys), min_size=1, max_size=4))


def run(w: Workload, mix: list[Item]) -> None:
    """Publish every item at once; the sequential ones then run round-robin in this thread."""
    sequences = []
    for item in mix:
        if item.kind == "chain":
            w.chain(item.mode, item.keys, item.seconds)
        elif item.kind == "group":
            w.group(item.mode, item.keys, item.seconds)
        elif item.kind == "chord":
            w.chord(item.mode, item.keys[:-1], item.seconds[:-1], body=item.keys[-1])
        elif item.kind == "burst":
            w.burst(item.mode, item.keys, item.seconds)
        else:
            sequences.append((item.mode, list(zip(item.keys, item.seconds, strict=True))))
    w.sequential(sequences)


def _settings() -> Any:
    return settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def _seeded(test: Any) -> Any:
    return seed(int(SEED))(test) if SEED is not None else test


@pytest.mark.explore
# An example waits at most 60 s for its tasks to end; a failure stops the run after one replay.
@pytest.mark.timeout(EXAMPLES * 10 + 180)
@_seeded
@_settings()
@given(example=workloads())
def test_generated_workloads_keep_the_progress_invariant(
    progress_app: Any, progress_workers: Workers, example: tuple[str, list[Item]]
) -> None:
    pool, mix = example
    queue, workers = progress_workers[pool]
    for worker in workers:
        assert worker.running, f"{worker!r} died; log tail:\n{worker.log_tail()}"
    w = Workload(progress_app, queue)
    note(f"pool {pool}, tag {w.tag}: " + "; ".join(map(str, mix)))
    run(w, mix)
    report = w.check()
    note(report.summary())
    assert not report.problems(), explain(report, w)
