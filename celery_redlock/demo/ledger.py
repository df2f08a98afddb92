"""The demo's ledger: what the producer sent and each worker process saw, summed up for the table.

Every process appends one JSON line per event to a file of its own in a shared directory (one
writer per file, so lines never interleave). The demo reads those files while the burst runs
(progress) and after it (the table). Times are ``time.monotonic()``, which on one machine is the
same clock in every process, so holds by different processes can be compared for overlap (by
the check the test suites use too, ``celery_redlock.testing.overlap``).

Events:

- ``sent`` (the producer): a call of ``invoice`` with ``task_id``, published ``via`` the task
  class (``app``, deduplicated at enqueue) or by name (``name``, ``app.send_task``, which is
  not); ``existing`` is the task id a deduplicated call was handed instead (None: published).
- ``run``: a body ran under the lock, from ``start`` to ``end``; ``acquire`` is how long taking
  the lock took, as the ``lock_acquired`` signal reported it; ``outcome`` is ``charged`` (it
  found the invoice unpaid and charged it) or ``already`` (it found it charged by ``charged_by``).
- ``retry``: an execution was postponed because another holder had the lock (it waited).
- ``done``: an execution ended with ``state`` (a Celery state; ``RETRY`` is not final);
  ``holder`` and ``reason`` when it was skipped because the lock was held.

:class:`Charges` is the shop's record of which invoices were charged: one file per invoice,
read and written by the body under the lock. It is a plain check-then-write, safe only under
the lock: were two bodies ever to hold one invoice at once, both could charge it, and the
summary would count the invoice charged twice.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..testing.overlap import Hold, find_overlaps

FINAL_SUCCESS = "SUCCESS"
NOT_FINAL = {"RETRY", "STARTED", "PENDING", "RECEIVED"}

# The ways a call can end: how the table names them, in its order.
CHARGED = "charged"
DEDUPLICATED = "deduplicated"
SKIPPED = "skipped"
ALREADY = "already"
# ...and the ways it must not: failed, never finished, or ended in a way that names no call of
# its own invoice (a duplicate of another invoice, a skip for a holder of another invoice).
FAILED = "failed"
UNFINISHED = "unfinished"
UNEXPLAINED = "unexplained"
LOST = (FAILED, UNFINISHED, UNEXPLAINED)


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


class Charges:
    """Which task charged each invoice: ``<directory>/charges/<invoice>`` holds its task id."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory) / "charges"

    def charged_by(self, invoice: int) -> str | None:
        try:
            return (self.directory / str(invoice)).read_text()
        except FileNotFoundError:
            return None

    def record(self, invoice: int, task_id: str) -> None:
        self.directory.mkdir(exist_ok=True)
        # Written whole then renamed, so a reader never sees half a task id. A rename replaces:
        # it excludes no one, so only the lock keeps a second charge out.
        part = self.directory / f"{invoice}.{os.getpid()}.part"
        part.write_text(task_id)
        os.replace(part, self.directory / str(invoice))


@dataclass(frozen=True)
class Call:
    """One call the producer made."""

    task_id: str
    invoice: int
    via: str
    existing: str | None


@dataclass(frozen=True)
class Run:
    """One body that ran while its process believed it held the lock."""

    task_id: str
    resource: str
    start: float
    end: float
    pid: int
    acquire: float
    outcome: str = CHARGED
    charged_by: str = ""

    @property
    def invoice(self) -> int:
        return int(self.resource.rpartition(":")[2])

    def hold(self) -> Hold:
        """The run's window for the overlap check; the run rides along so an overlap leads back
        to its pids."""
        return Hold(self.resource, self.start, self.end, owner=self.task_id, info=self)


@dataclass(frozen=True)
class Skip:
    """A run skipped because ``holder`` held its invoice's lock."""

    holder: str | None
    reason: str


@dataclass
class LedgerReader:
    """Reads every process's file incrementally; keeps what it has read."""

    directory: Path
    calls: dict[str, Call] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    retried: set[str] = field(default_factory=set)  # for the lock held
    unavailable: set[str] = field(default_factory=set)  # for masters that did not answer
    final: dict[str, str] = field(default_factory=dict)
    skips: dict[str, Skip] = field(default_factory=dict)
    deduplicated: int = 0
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
        if event == "sent":
            call = Call(record["task_id"], record["invoice"], record["via"], record["existing"])
            self.calls[call.task_id] = call
            self.deduplicated += call.existing is not None
        elif event == "run":
            fields = ("task_id", "resource", "start", "end", "pid", "acquire", "outcome", "charged_by")
            self.runs.append(Run(**{name: record[name] for name in fields if name in record}))
        elif event == "retry":
            (self.unavailable if record.get("unavailable") else self.retried).add(record["task_id"])
        elif event == "done" and record["state"] not in NOT_FINAL:
            self.final[record["task_id"]] = record["state"]
            if "reason" in record:
                self.skips[record["task_id"]] = Skip(record.get("holder"), record["reason"])

    @property
    def finished(self) -> int:
        """Calls ended: deduplicated at enqueue (at once) or their execution's final state."""
        return self.deduplicated + len(self.final)


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
    waited: int  # runs retried because the lock was held
    overlaps: list[tuple[Run, Run]]
    acquire_p50: float
    acquire_p99: float
    # How each call ended (CHARGED, DEDUPLICATED, SKIPPED, ALREADY, or one of LOST), by task id.
    ended: dict[str, str] = field(default_factory=dict)
    # How many times each invoice was charged (0 for one never charged).
    charges: dict[int, int] = field(default_factory=dict)
    # Runs retried because no quorum of masters answered (a master killed mid-round).
    unavailable: int = 0

    def count(self, *ways: str) -> int:
        """How many calls ended one of ``ways``."""
        return sum(1 for way in self.ended.values() if way in ways)

    @property
    def skipped(self) -> int:
        return self.count(SKIPPED)

    @property
    def lost(self) -> int:
        """Calls that ended none of the four ways, counting those never recorded as sent."""
        return self.count(*LOST) + self.submitted - len(self.ended)

    @property
    def charged_once(self) -> int:
        return sum(1 for n in self.charges.values() if n == 1)

    @property
    def ok(self) -> bool:
        return (
            not self.overlaps
            and self.finished == self.submitted
            and self.lost == 0
            and self.charged_once == len(self.charges)
        )


def how_it_ended(reader: LedgerReader, call: Call, runs: dict[str, Run]) -> str:
    """How ``call`` ended: charged, deduplicated, skipped, already (charged), or one of LOST.

    A deduplicated call and a skipped run are accounted for only when the task they name is a
    call of the same invoice (a duplicate of nothing else)."""
    if call.existing is not None:
        return DEDUPLICATED if _of_invoice(reader, call.existing, call.invoice) else UNEXPLAINED
    state = reader.final.get(call.task_id)
    if state is None:
        return UNFINISHED
    if state != FINAL_SUCCESS:
        return FAILED
    run = runs.get(call.task_id)
    if run is not None:
        return run.outcome
    skip = reader.skips.get(call.task_id)
    if skip is not None and _of_invoice(reader, skip.holder, call.invoice):
        return SKIPPED
    return UNEXPLAINED


def _of_invoice(reader: LedgerReader, task_id: str | None, invoice: int) -> bool:
    other = reader.calls.get(task_id or "")
    return other is not None and other.invoice == invoice


def summarize(reader: LedgerReader, submitted: int) -> Summary:
    runs = {run.task_id: run for run in reader.runs}
    ended = {task_id: how_it_ended(reader, call, runs) for task_id, call in reader.calls.items()}
    # Counted from the bodies, whatever their calls' end: a charge is a charge.
    charges = Counter(run.invoice for run in reader.runs if run.outcome == CHARGED)
    invoices = {call.invoice for call in reader.calls.values()} | set(charges)
    acquire = [run.acquire for run in reader.runs]
    return Summary(
        submitted=submitted,
        finished=reader.finished,
        ran=len(reader.runs),
        waited=len(reader.retried),
        # As runs, not windows: the demo prints the pids of each overlapping pair.
        overlaps=[(o.first.info, o.second.info) for o in find_overlaps(r.hold() for r in reader.runs)],
        acquire_p50=percentile(acquire, 0.50),
        acquire_p99=percentile(acquire, 0.99),
        ended=ended,
        charges={invoice: charges[invoice] for invoice in sorted(invoices)},
        unavailable=len(reader.unavailable),
    )
