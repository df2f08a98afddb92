"""The progress invariant of DESIGN.md, checked from a run's recorded history alone.

    Every published task ends exactly one way: it ran once; or it was skipped, failed
    (LockNotAcquired) or deduplicated while the holder it names was holding (its body had started
    and not finished, or its marker was still queued); a redelivered copy of a dead run waits
    for its lock.

    Sequential rule: once a locked run's completion is visible (its result stored, its chain's
    next link published, a ``.get()`` returned), another run's acquire of that lock that starts
    afterwards is not refused by that lock.

What the checker reads (nothing else: no Celery, no Redis):

- ``published``: what the client published, each task id with its key and what is known of its
  causes: ``after``, the tasks whose completion was visible before it was published (a chain's
  previous link, a chord's header, the ``.get()`` that returned before the next ``delay()``),
  and ``requires``, the tasks whose success publishes it (a chain link, a chord body). A task
  whose ``requires`` did not all succeed was never published: it is *cancelled*, not lost.
- ``events``: the history the workers wrote (see ``progressapp.py``): ``start``/``end`` of each
  body execution (``run``), each ``refused`` lock attempt (``t_try`` .. ``t`` bracket the
  decision; ``holder`` is the task id it names), ``visible`` (Celery's ``task_success``, after
  the result was stored and the next link published), ``released`` (``lock_released``), and
  ``deduplicated`` (a publish that sent nothing because ``existing`` was queued or running).
- ``results``: what the result backend holds per task id: its state, whether its value is the
  skip marker, the holder the marker or the ``LockNotAcquired`` names, the error's class name.

The rules, each reported under its own name:

1. ``outcome``: each published task has exactly one outcome, read from the backend and checked
   against the history. *ran*: SUCCESS, not the skip marker, one finished execution of its body
   and no skip/fail refusal. *skipped*: SUCCESS with the marker, no execution, exactly one skip
   refusal, naming the same holder as the marker. *failed*: FAILURE with ``LockNotAcquired``, no
   execution, exactly one fail (or exhausted) refusal, naming the same holder as the error.
   *deduplicated*: a ``deduplicated`` event and no result. Anything else (never ended, an error
   of its own, a skip that also ran, a success without a body, a skip or fail naming nobody) is
   lost work.
2. ``once``: a body runs at most once per task id. An execution that started and never ended
   (its process died) may be followed by one more: the redelivered copy.
3. ``holding``: every refusal (any policy, when the masters refused because another token held
   the key) and every deduplication is explained by a holder: a run of the same key (the named
   one, when a holder is named; another task's, or an earlier delivery of the same task id)
   whose hold ``[acquire round start - TOLERANCE, body end + TOLERANCE]`` meets the refusal's
   window ``[t_try, t]``. A skip or fail that names the refused task itself is a violation: a
   redelivered copy must wait for its dead run's lock.
4. ``sequential``: a refusal is never explained by a holder whose completion was visible before
   the refused attempt began (``t_try >= visible``), nor by a holder the refused task was
   published after (``after``, transitively). This needs no tolerance: both are causal facts
   (``t_try`` is taken at ``task_prerun``, before the acquire; ``visible`` after the result was
   stored), or times on one clock in the order the rule states them.
5. ``exclusion``: no two finished executions of one key overlap
   (:func:`celery_redlock.testing.find_overlaps` on ``[start, end)``).

``TOLERANCE`` (0.1 s) covers only what the body cannot record about its own hold: the moments
between the acquire round and the body's first line, and between the body's last line and the
release having taken effect on the masters (one round trip, plus whatever the scheduler of a
loaded 2-core host adds). Rule 4 carries no tolerance, and it is the one that sees a release that
comes after the completion is visible, however short the gap.

Also reported, not judged: refusals by policy, and ``late_releases``, runs whose
``lock_released`` came after their ``visible`` (the design's "the release takes effect before
the run's completion is visible", observed through the public signal: the cause when rule 4
fails).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_redlock.testing import Hold, Overlap, find_overlaps

TOLERANCE = 0.1  # seconds; see the module docstring
FINAL_REFUSALS = ("skip", "fail", "exhausted")
ENDED = ("SUCCESS", "FAILURE")
_TASK_ID = re.compile(r"\b[0-9a-f]{32}\b")


def holder_task_id(described: str) -> str | None:
    """The task id in a holder as ``LockNotAcquired.holder`` describes it (``task <name> <id> on
    <host> pid <pid> for <s> s``), or None. Every task id here is a 32-digit hex uuid (the
    harness gives each its own), so the id is found whatever the wording around it."""
    found = _TASK_ID.search(described)
    return found.group(0) if found else None


@dataclass(frozen=True)
class Published:
    """One task id the client published (or that a publish of it will publish: a chain link)."""

    task_id: str
    key: str
    after: tuple[str, ...] = ()  # completions visible before it was published
    requires: tuple[str, ...] = ()  # tasks whose success publishes it
    t: float | None = None  # when the client published it, if it did


@dataclass(frozen=True)
class Result:
    """What the result backend holds for one task id."""

    state: str  # SUCCESS, FAILURE, or anything else: not ended
    skipped: bool = False
    holder: str | None = None  # named by the skip marker or the LockNotAcquired
    error: str = ""  # the exception's class name, for FAILURE


@dataclass(frozen=True)
class Run:
    """One execution of a body."""

    task_id: str
    key: str
    run: str
    start: float
    end: float | None
    acquire_round: float  # when the acquire round that granted this run's lock began, at latest
    visible: float | None  # its completion became visible (task_success)
    released: float | None

    def meets(self, low: float, high: float, tolerance: float) -> bool:
        """Whether the hold ``[acquire round - tol, end + tol]`` meets ``[low, high]``."""
        end = math.inf if self.end is None else self.end + tolerance
        return low <= end and high >= self.acquire_round - tolerance

    def __str__(self) -> str:
        end = "never" if self.end is None else f"{self.end:.3f}"
        return f"{self.task_id} (body {self.start:.3f}..{end})"


@dataclass(frozen=True)
class Refusal:
    task_id: str
    key: str
    policy: str
    t_try: float
    t: float
    holder: str | None
    held: bool  # refused because another token held the key (not for want of a quorum)

    def __str__(self) -> str:
        named = f" naming {self.holder}" if self.holder else ""
        return f"{self.policy} of {self.task_id} on {self.key} in [{self.t_try:.3f}, {self.t:.3f}]{named}"


@dataclass(frozen=True)
class Violation:
    rule: str
    task_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.task_id}: {self.detail}"


@dataclass
class Report:
    tasks: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    overlaps: list[Overlap] = field(default_factory=list)
    late_releases: int = 0

    def of(self, rule: str) -> list[Violation]:
        return [v for v in self.violations if v.rule == rule]

    @property
    def lost(self) -> int:
        """Tasks that did not end in exactly one of the allowed ways."""
        return len({v.task_id for v in self.violations if v.rule in ("outcome", "once")})

    def problems(self) -> list[str]:
        return [str(v) for v in self.violations] + [f"exclusion: {o}" for o in self.overlaps]

    def summary(self) -> str:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())) or "none"
        refusals = ", ".join(f"{k} {v}" for k, v in sorted(self.refusals.items())) or "none"
        rules = ", ".join(
            f"{rule} {len(self.of(rule))}" for rule in ("outcome", "once", "holding", "sequential")
        )
        return (
            f"{self.tasks} tasks: {outcomes}; refusals: {refusals}; violations: {rules}, "
            f"exclusion {len(self.overlaps)}; released after visible: {self.late_releases}"
        )


@dataclass
class _History:
    runs: list[Run]
    refusals: list[Refusal]
    dedups: dict[str, Mapping[str, Any]]


def _read_history(events: Iterable[Mapping[str, Any]]) -> _History:
    starts: dict[str, Mapping[str, Any]] = {}
    ends: dict[str, float] = {}
    visible: dict[str, float] = {}
    released: dict[str, float] = {}
    refusals: list[Refusal] = []
    dedups: dict[str, Mapping[str, Any]] = {}
    for event in events:
        kind = event["event"]
        if kind == "start":
            starts[event["run"]] = event
        elif kind == "end":
            ends[event["run"]] = event["t"]
        elif kind == "visible":
            visible[event["task_id"]] = event["t"]
        elif kind == "released":
            released[event["task_id"]] = event["t"]
        elif kind == "refused":
            t_try = event.get("t_try")
            refusals.append(
                Refusal(
                    event["task_id"],
                    event["key"],
                    event["policy"],
                    event["t"] if t_try is None else t_try,
                    event["t"],
                    event.get("holder") or None,
                    event.get("held", True),
                )
            )
        elif kind == "deduplicated":
            dedups[event["task_id"]] = event
    runs = []
    for run, start in starts.items():
        acquired, elapsed = start.get("t_acquired"), start.get("elapsed")
        acquire_round = start["t"] if acquired is None else acquired - (elapsed or 0.0)
        task_id = start["task_id"]
        end = ends.get(run)
        runs.append(
            Run(
                task_id,
                start["key"],
                run,
                start["t"],
                end,
                acquire_round,
                visible.get(task_id) if end is not None else None,
                released.get(task_id) if end is not None else None,
            )
        )
    runs.sort(key=lambda r: r.start)
    return _History(runs, refusals, dedups)


def check(
    published: Iterable[Published],
    events: Iterable[Mapping[str, Any]],
    results: Mapping[str, Result],
    *,
    tolerance: float = TOLERANCE,
) -> Report:
    """Judge one history by the module's rules."""
    tasks = {p.task_id: p for p in published}
    history = _read_history(events)
    runs_of: dict[str, list[Run]] = defaultdict(list)
    runs_by_key: dict[str, list[Run]] = defaultdict(list)
    for run in history.runs:
        runs_of[run.task_id].append(run)
        runs_by_key[run.key].append(run)
    refusals_of: dict[str, list[Refusal]] = defaultdict(list)
    for refusal in history.refusals:
        refusals_of[refusal.task_id].append(refusal)
    report = Report(tasks=len(tasks))
    cancelled = _cancelled(tasks, results)
    for task in tasks.values():
        kind, found = _outcome(
            task,
            results.get(task.task_id),
            runs_of[task.task_id],
            refusals_of[task.task_id],
            task.task_id in history.dedups,
            task.task_id in cancelled,
        )
        report.outcomes[kind] += 1
        report.violations += found
    causes = _Causes(tasks)
    for refusal in history.refusals:
        report.refusals[refusal.policy] += 1
        if refusal.held:
            report.violations += _judge_refusal(refusal, runs_by_key[refusal.key], causes, tolerance)
    for task_id, event in history.dedups.items():
        report.violations += _judge_dedup(task_id, event, tasks, runs_of, causes, tolerance)
    report.overlaps = find_overlaps(
        Hold(run.key, run.start, run.end, owner=run.task_id, info=run)
        for run in history.runs
        if run.end is not None
    )
    report.late_releases = sum(
        1
        for run in history.runs
        if run.visible is not None and run.released is not None and run.released > run.visible
    )
    return report


def _cancelled(tasks: Mapping[str, Published], results: Mapping[str, Result]) -> set[str]:
    """Tasks never published because a task whose success publishes them did not succeed."""
    memo: dict[str, bool] = {}

    def cancelled(task_id: str) -> bool:
        if task_id not in memo:
            memo[task_id] = False  # a cycle (none is possible) counts as published
            task = tasks.get(task_id)
            memo[task_id] = task is not None and any(
                cancelled(r) or _state(results.get(r)) == "FAILURE" for r in task.requires
            )
        return memo[task_id]

    return {task_id for task_id in tasks if cancelled(task_id)}


def _state(result: Result | None) -> str:
    return "PENDING" if result is None else result.state


def _outcome(
    task: Published,
    result: Result | None,
    runs: list[Run],
    refusals: list[Refusal],
    deduplicated: bool,
    cancelled: bool,
) -> tuple[str, list[Violation]]:
    """(the task's outcome, what breaks rules 1 and 2 in it)."""
    tid = task.task_id
    finished = [r for r in runs if r.end is not None]
    final = [r for r in refusals if r.policy in FINAL_REFUSALS]
    state = _state(result)
    found = _once(tid, runs)

    def lost(detail: str) -> tuple[str, list[Violation]]:
        return "lost", [*found, Violation("outcome", tid, detail)]

    if deduplicated:
        if runs or state in ENDED:
            return lost(f"deduplicated at publish, yet {len(runs)} run(s) and state {state}")
        return "deduplicated", found
    if cancelled and not runs and not refusals:
        # Never published: Celery stores the failure that stopped a chain for each of its later
        # links too, and a ChordError for a chord body whose header failed.
        return "cancelled", found
    if state not in ENDED:
        return lost(f"never ended (state {state}, {len(runs)} run(s), refusals {_policies(refusals)})")
    assert result is not None
    if result.skipped or result.error == "LockNotAcquired":
        kind = "skipped" if result.skipped else "failed"
        if runs:
            return lost(f"{kind}, yet its body ran {len(runs)} time(s)")
        if len(final) != 1:
            return lost(f"{kind} with refusals {_policies(refusals)}: not exactly one skip/fail")
        if kind == "skipped" and final[0].policy != "skip":
            return lost(f"skipped, but its refusal was a {final[0].policy}")
        if result.holder is None or final[0].holder is None:
            return lost(f"{kind} naming no holder (result {result.holder}, refusal {final[0].holder})")
        if result.holder != final[0].holder:
            return lost(f"{kind}: the result names {result.holder}, the refusal {final[0].holder}")
        return kind, found
    if state == "FAILURE":
        return lost(f"failed with {result.error or 'an unknown error'}")
    if not finished:
        return lost("SUCCESS without a finished run of its body")
    if final:
        return lost(f"ran, yet also refused: {_policies(refusals)}")
    return "ran", found


def _once(task_id: str, runs: list[Run]) -> list[Violation]:
    """Rule 2: one finished run; before it, only executions that never ended (died)."""
    finished = [r for r in runs if r.end is not None]
    if len(finished) > 1:
        return [
            Violation("once", task_id, f"its body ran {len(finished)} times: {', '.join(map(str, runs))}")
        ]
    dead = [r for r in runs if r.end is None]
    if dead and (not finished or any(d.start > finished[0].start for d in dead)):
        return [Violation("once", task_id, f"an execution started and never ended: {dead[-1]}")]
    return []


def _policies(refusals: list[Refusal]) -> str:
    return ",".join(r.policy for r in refusals) or "none"


class _Causes:
    """Which tasks a task was published after (``after``, transitively)."""

    def __init__(self, tasks: Mapping[str, Published]) -> None:
        self.tasks = tasks
        self.memo: dict[str, frozenset[str]] = {}

    def before(self, task_id: str) -> frozenset[str]:
        if task_id not in self.memo:
            self.memo[task_id] = frozenset()
            task = self.tasks.get(task_id)
            direct = set(task.after) if task is not None else set()
            found = set(direct)
            for cause in direct:
                found |= self.before(cause)
            self.memo[task_id] = frozenset(found)
        return self.memo[task_id]


def _sequential(task_id: str, began: float, holder: Run, causes: _Causes, what: str = "its attempt") -> str:
    """Why rule 4 forbids ``holder`` to explain the refusal of ``task_id`` (``what`` began at
    ``began``), or ""."""
    if holder.task_id in causes.before(task_id):
        return f"it was published after {holder.task_id}'s completion"
    if holder.visible is not None and began >= holder.visible:
        return (
            f"{what} began {1000 * (began - holder.visible):.1f} ms after "
            f"{holder.task_id}'s completion was visible"
        )
    return ""


def _judge_refusal(refusal: Refusal, runs: list[Run], causes: _Causes, tolerance: float) -> list[Violation]:
    """Rules 3 and 4 for one refusal."""
    tid = refusal.task_id
    if refusal.holder == tid and refusal.policy in FINAL_REFUSALS:
        return [
            Violation(
                "holding", tid, f"{refusal}: named an earlier run of itself, and did not wait for its lock"
            )
        ]
    candidates = [
        run
        for run in runs
        if (refusal.holder is None or run.task_id == refusal.holder)
        and (run.task_id != tid or run.start < refusal.t_try)  # an earlier delivery of itself
    ]
    meeting = [run for run in candidates if run.meets(refusal.t_try, refusal.t, tolerance)]
    why_not = [_sequential(tid, refusal.t_try, run, causes) for run in meeting]
    if any(not why for why in why_not):
        return []
    if meeting:
        return [Violation("sequential", tid, f"{refusal}: {why_not[0]}")]
    if refusal.holder is not None and not candidates:
        return [Violation("holding", tid, f"{refusal}: the holder it names never ran on this key")]
    if refusal.holder is not None:
        return [Violation("holding", tid, f"{refusal}: the holder was not holding: {candidates[-1]}")]
    return [Violation("holding", tid, f"{refusal}: no run of this key was holding")]


def _judge_dedup(
    task_id: str,
    event: Mapping[str, Any],
    tasks: Mapping[str, Published],
    runs_of: Mapping[str, list[Run]],
    causes: _Causes,
    tolerance: float,
) -> list[Violation]:
    """Rule 3 for a deduplication: the task it names was queued (published, not yet started) or
    running at the time, and rule 4: its completion was not yet visible."""
    existing, at = event.get("existing"), event["t"]
    what = f"deduplicated at {at:.3f} naming {existing}"
    named = tasks.get(existing) if existing else None
    if named is None:
        return [Violation("holding", task_id, f"{what}, which is no task published here")]
    if named.t is not None and named.t > at + tolerance:
        return [Violation("holding", task_id, f"{what}, published only at {named.t:.3f}")]
    for run in runs_of.get(existing, []):
        why = _sequential(task_id, at, run, causes, what="the publish")
        if why:
            return [Violation("sequential", task_id, f"{what}: {why}")]
        if run.end is not None and at > run.end + tolerance:
            return [Violation("holding", task_id, f"{what}: it had already ended: {run}")]
    return []
