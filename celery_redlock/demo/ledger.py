"""The demo's ledger: what each worker process saw, summed up for the demo's table.

Every worker process appends one JSON line per event to a file of its own in a shared directory
(one writer per file, so lines never interleave). The demo reads those files while the burst runs
(progress) and after it (the table). Times are ``time.monotonic()``, which on one machine is the
same clock in every process, so holds by different processes can be compared for overlap (by
the check the test suites use too, ``celery_redlock.testing.overlap``).

Events:

- ``run``: a body ran under the lock, from ``start`` to ``end``; ``acquire`` is how long taking
  the lock took, as the ``lock_acquired`` signal reported it.
- ``retry``: an execution was postponed because another holder had the lock (it waited).
- ``done``: an execution ended with ``state`` (a Celery state); ``RETRY`` is not final.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..testing.overlap import Hold, find_overlaps

FINAL_SUCCESS = "SUCCESS"
FAILURE = "FAILURE"
NOT_FINAL = {"RETRY", "STARTED", "PENDING", "RECEIVED"}


class LedgerWriter:
    """Appends events to ``<directory>/<pid>.jsonl``; a forked child opens its own file."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._pid = -1
        self._fd = -1

    def write(self, event: str, **fields: Any) -> None:
        pid = os.getpid()
        if pid != self._pid:
            self._fd = os.open(self.directory / f"{pid}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._pid = pid
        line = json.dumps({"event": event, "pid": pid, **fields}, separators=(",", ":")) + "\n"
        # One write() per line with O_APPEND: a reader sees whole lines or nothing of one.
        os.write(self._fd, line.encode())


@dataclass(frozen=True)
class Run:
    """One body that ran while its process believed it held the lock."""

    task_id: str
    resource: str
    start: float
    end: float
    pid: int
    acquire: float

    def hold(self) -> Hold:
        """The run's window for the overlap check; the run rides along so an overlap leads back
        to its pids."""
        return Hold(self.resource, self.start, self.end, owner=self.task_id, info=self)


@dataclass
class LedgerReader:
    """Reads every process's file incrementally; keeps what it has read."""

    directory: Path
    runs: list[Run] = field(default_factory=list)
    retried: set[str] = field(default_factory=set)
    final: dict[str, str] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def poll(self) -> None:
        """Read the complete lines written since the last poll."""
        for path in sorted(self.directory.glob("*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[path] = offset + len(complete)
            for line in complete.splitlines():
                if line.strip():
                    self._take(json.loads(line))

    def _take(self, record: dict[str, Any]) -> None:
        event = record["event"]
        if event == "run":
            self.runs.append(
                Run(
                    record["task_id"],
                    record["resource"],
                    record["start"],
                    record["end"],
                    record["pid"],
                    record["acquire"],
                )
            )
        elif event == "retry":
            self.retried.add(record["task_id"])
        elif event == "done" and record["state"] not in NOT_FINAL:
            self.final[record["task_id"]] = record["state"]

    @property
    def finished(self) -> int:
        return len(self.final)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(fraction * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class Summary:
    """What the demo's table shows."""

    submitted: int
    finished: int
    ran: int
    waited: int
    skipped: int
    failed: int
    overlaps: list[tuple[Run, Run]]
    acquire_p50: float
    acquire_p99: float

    @property
    def ok(self) -> bool:
        return not self.overlaps and self.finished == self.submitted


def summarize(reader: LedgerReader, submitted: int) -> Summary:
    ran_ids = {run.task_id for run in reader.runs}
    failed = sum(1 for state in reader.final.values() if state == FAILURE)
    # A duplicate that ended without a body and without failing was skipped by the lock policy.
    skipped = sum(1 for task_id, state in reader.final.items() if task_id not in ran_ids and state != FAILURE)
    acquire = [run.acquire for run in reader.runs]
    return Summary(
        submitted=submitted,
        finished=reader.finished,
        ran=len(reader.runs),
        waited=len(reader.retried),
        skipped=skipped,
        failed=failed,
        # As runs, not windows: the demo prints the pids of each overlapping pair.
        overlaps=[(o.first.info, o.second.info) for o in find_overlaps(r.hold() for r in reader.runs)],
        acquire_p50=percentile(acquire, 0.50),
        acquire_p99=percentile(acquire, 0.99),
    )
