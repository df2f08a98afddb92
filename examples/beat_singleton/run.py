"""Two HA beats and a worker on real processes; the leading beat is killed half-way.

    python examples/beat_singleton/run.py

Starts five embedded masters, an embedded broker, one worker and two ``celery beat`` processes
(needs celery-redlock[embedded]), stops them all on the way out, and exits 0 iff the job ran
before and after the failover and no two runs overlapped.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from celery_redlock import Redlock
from celery_redlock.beat import read_leader
from celery_redlock.testing import CeleryBeat, CeleryWorker, Hold, RedisServer, ServerSet, find_overlaps

HERE = Path(__file__).resolve().parent


def runs(path: Path) -> list[dict[str, float]]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line]


def wait(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout}s")
        time.sleep(0.1)


def main() -> int:
    with ServerSet(5) as masters, RedisServer() as broker, tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "runs.jsonl"
        env = {
            "CELERY_BROKER_URL": broker.url,
            "REDLOCK_MASTERS": ",".join(masters.urls),
            "RUNS_FILE": str(record),
        }
        common = {"env": env, "cwd": HERE, "pythonpath": [HERE]}
        with (
            CeleryWorker("tasks", concurrency=2, **common) as worker,
            CeleryBeat("tasks", **common) as beat_a,
            CeleryBeat("tasks", **common) as beat_b,
            Redlock(masters.urls) as redlock,
        ):
            wait(lambda: len(runs(record)) >= 2, 30, "two runs")
            leader = read_leader(redlock, "beat:beat_singleton")
            assert leader is not None
            victim = beat_a if leader["pid"] == beat_a.pid else beat_b
            victim.kill()
            killed_at = time.time()
            print(f"killed the leading beat (pid {leader['pid']}) after {len(runs(record))} runs")
            wait(
                lambda: sum(r["start"] > killed_at for r in runs(record)) >= 2,
                30,
                "two runs after the failover",
            )
            skipped = worker.log_text().count("skipped: lock")

        done = runs(record)
        overlaps = len(find_overlaps(Hold("rebuild_search_index", r["start"], r["end"]) for r in done))
        after = sum(r["start"] > killed_at for r in done)
        print(
            f"{len(done)} runs ({after} after the failover), {skipped} slots skipped while a run "
            f"was still going, {overlaps} overlapping runs"
        )
        return 0 if overlaps == 0 and after >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
