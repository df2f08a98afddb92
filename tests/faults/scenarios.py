"""What each scenario runs, and what it must show.

Within the algorithm's assumptions (a minority of masters faulty at a time, restarts delayed past
the TTL or with fsynced data, bounded clock drift) a scenario must show zero overlaps, zero lost
updates and a lock that stays available. Outside them (``expect="violation"``) the checker must
*find* the overlap: that is what proves it is not blind.

Most scenarios also have a *fenced* resource (``fenced``: ``fres<i>`` beside the plain
``res<i>``), locked with ``fenced=True`` and written through ``FencedKey``: within the
assumptions it must show zero fence violations and a serial fenced history. The ``stale-writer``
scenario shows what fencing is for: a holder paused between its last ``ensure()`` and its write
writes late, which on the plain resource **must** lose an update (Redlock's known limit, shown)
and on the fenced one must be refused.

``fence-clock-ahead`` is built to break fences outside their assumptions, so the fence check must
*find* violations (``fenced_expect="required"``): master 0's clock runs 60 s ahead, so fences
from quorums that include it carry its clock; group 1 never reaches master 0; masters 1-4 are
killed and restarted empty without delay, losing their counters (and keys: the lock overlaps
too), and the next quorum without master 0 reads only the normal clocks and issues a lower
fence. Its control, ``fence-clock-ahead-fsync``, keeps the counters (``appendfsync always``):
no violation.

The two out-of-assumption lock scenarios and their controls share one layout: group A never
reaches masters 3 and 4, group B never reaches 0 and 1, so every hold is granted by exactly three
masters and the two groups meet only on master 2. Whatever makes master 2 forget a key early (an
empty restart, a fast clock) lets the other group in while the holder still holds.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from celery_redlock.lock.masters import BACKOFF_CAP

from .celery_workload import CONCURRENCY, celery_workers, produce
from .checker import Report, check
from .client import ClientConfig, run_client
from .cluster import Cluster, ClusterSpec
from .nemesis import Nemesis
from .register import CELERY_FAILURES, EVENTS, FENCED_PREFIX, Register

SHARED_ONLY_ON_2 = {0: (3, 4), 1: (0, 1)}
# fence-clock-ahead: master 0's clock this many seconds ahead of the others (libfaketime), and
# group 1 never reaches it, so its quorums read only the counters and clocks of masters 1-4.
FAST_MASTER_0 = {0: 60.0}
WITHOUT_0 = {1: (0,)}


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    faults: Sequence[str] = ()  # Nemesis method names
    victims: Sequence[int] | None = None  # fixed victims; None: a random minority each time
    concurrent: bool = False
    expect: Literal["safe", "violation"] = "safe"
    available: bool = True  # assert the lock stays available (a majority is always up)
    threads: int = 3  # per group
    processes: int = 1  # per group
    resources: int = 2
    ttl: float = 1.0
    hold: tuple[float, float] = (0.05, 0.3)
    abandon: float = 0.05
    extend: float = 0.2
    limit: str = ""  # for a violation: the known limit and the operator rule that avoids it
    celery_workers: int = 0  # > 0: the workload is RedlockTask runs in real prefork workers
    client_mode: str = "plain"  # plain, waiting, fair or reentrant (see client.py)
    fenced: int = 0  # fenced resources (fres<i>) beside the plain ones; not with fair or reentrant
    # Lost updates on the plain resources: forbidden, or required (a stale writer's, shown).
    plain_lost: Literal["forbidden", "required"] = "forbidden"
    # The fence checks: asserted (safe), only reported (outside the assumptions), or violations
    # required (a scenario built to break fences: the checker must find it).
    fenced_expect: Literal["safe", "reported", "required"] = "safe"


SCENARIOS: list[Scenario] = [
    Scenario(
        "kill-delayed", "kill 1-2 masters, restart empty after 1.5 x TTL", faults=["kill_delayed"], fenced=1
    ),
    Scenario(
        "kill-fsync",
        "kill 1-2 masters, restart at once with appendfsync-always data",
        cluster=ClusterSpec(persistent=True),
        faults=["kill_fsync"],
        fenced=1,
    ),
    Scenario("pause-master", "SIGSTOP 1-2 masters for 1.5 x TTL", faults=["pause_master"], fenced=1),
    Scenario(
        "partition",
        "2 client groups, each with its own drop/delay/black-hole/cut faults",
        cluster=ClusterSpec(groups=2),
        faults=["partition"],
        threads=2,
        fenced=1,
    ),
    Scenario(
        "client-pause",
        "a holder process SIGSTOPs past its TTL, then resumes",
        faults=["client_pause"],
        threads=1,
        processes=3,
        resources=1,
        ttl=0.5,
        fenced=1,
    ),
    Scenario(
        "stale-writer",
        "a holder (thread or process) pauses after its last ensure() and before its write, past "
        "its validity, then writes: plain and fenced resources",
        faults=["stale_writer"],
        threads=2,
        processes=2,
        resources=1,
        fenced=1,
        ttl=0.5,
        plain_lost="required",
        limit="a holder that pauses between its last check and its write writes after its lease "
        "ended; no client-side check closes that window: lock with fenced=True and have the "
        "resource refuse stale fences (celery_redlock.fenced)",
    ),
    Scenario(
        "combined",
        "all of the above, one or two at once, on a random minority",
        cluster=ClusterSpec(persistent=True, groups=2),
        faults=["kill_delayed", "kill_fsync", "pause_master", "partition", "client_pause"],
        concurrent=True,
        threads=2,
        fenced=1,
    ),
    Scenario(
        "clock-bounded",
        "master 2's clock 0.5% fast (drift_factor 1%), A/B layout",
        cluster=ClusterSpec(groups=2, cut_from=SHARED_ONLY_ON_2, clock_rates={2: 1.005}),
        threads=2,
        processes=0,
        resources=1,
        hold=(0.3, 0.7),
        abandon=0.4,
        available=False,
        fenced=1,
    ),
    Scenario(
        "clock-fast",
        "master 2's clock 2x fast, A/B layout",
        cluster=ClusterSpec(groups=2, cut_from=SHARED_ONLY_ON_2, clock_rates={2: 2.0}),
        threads=2,
        processes=0,
        resources=1,
        hold=(0.3, 0.7),
        abandon=0.4,
        expect="violation",
        available=False,
        limit="a master whose clock runs faster than drift_factor allows expires keys early; "
        "keep masters on NTP-slewed clocks (never stepped) and drift_factor above "
        "the worst rate error",
        fenced=1,
        fenced_expect="reported",
    ),
    Scenario(
        "restart-empty",
        "kill master 2, restart it empty at once, A/B layout",
        cluster=ClusterSpec(groups=2, cut_from=SHARED_ONLY_ON_2),
        faults=["kill_empty"],
        victims=[2],
        threads=2,
        processes=0,
        resources=1,
        ttl=2.0,
        hold=(0.3, 0.7),
        abandon=0.0,
        expect="violation",
        available=False,
        limit="a master that restarts without its data forgets the locks it granted; "
        "keep a restarted master out for longer than the largest TTL, or run it "
        "with appendfsync always",
        fenced=1,
        fenced_expect="reported",
    ),
    Scenario(
        "restart-delayed",
        "as restart-empty, restart after 1.5 x TTL",
        cluster=ClusterSpec(groups=2, cut_from=SHARED_ONLY_ON_2),
        faults=["kill_delayed"],
        victims=[2],
        threads=2,
        processes=0,
        resources=1,
        ttl=2.0,
        hold=(0.3, 0.7),
        abandon=0.0,
        available=False,
        fenced=1,
    ),
    Scenario(
        "restart-fsync",
        "as restart-empty, with appendfsync-always data kept",
        cluster=ClusterSpec(groups=2, cut_from=SHARED_ONLY_ON_2, persistent=True),
        faults=["kill_fsync"],
        victims=[2],
        threads=2,
        processes=0,
        resources=1,
        ttl=2.0,
        hold=(0.3, 0.7),
        abandon=0.0,
        available=False,
        fenced=1,
    ),
    Scenario(
        "fence-clock-ahead",
        "master 0's clock 60 s ahead, group 1 cut from it; masters 1-4 killed and restarted empty at once",
        cluster=ClusterSpec(groups=2, cut_from=WITHOUT_0, clock_offsets=FAST_MASTER_0),
        faults=["kill_empty"],
        victims=[1, 2, 3, 4],
        threads=2,
        processes=1,
        resources=1,
        hold=(0.3, 0.7),
        expect="violation",
        available=False,
        limit="the clock floor covers a master that lost its counter only if its clock is not "
        "behind the clock that issued recent fences by more than its downtime; run masters with "
        "appendfsync always (or keep an emptied one out for longer than the worst clock error), "
        "on NTP-slewed clocks",
        fenced=1,
        fenced_expect="required",
    ),
    Scenario(
        "fence-clock-ahead-fsync",
        "as fence-clock-ahead, restarted at once with appendfsync-always data",
        cluster=ClusterSpec(groups=2, cut_from=WITHOUT_0, persistent=True, clock_offsets=FAST_MASTER_0),
        faults=["kill_fsync"],
        victims=[1, 2, 3, 4],
        threads=2,
        processes=1,
        resources=1,
        hold=(0.3, 0.7),
        available=False,
        fenced=1,
    ),
    Scenario(
        "waiting",
        "clients block in acquire(timeout), woken by releases: masters killed and paused, "
        "their pub/sub connections dropped, a holder process SIGSTOPped",
        faults=["kill_delayed", "pause_master", "kill_pubsub", "client_pause"],
        client_mode="waiting",
        threads=2,
        processes=2,
        resources=1,
        fenced=1,  # fenced waiters too: woken by the release, and by the holder's expiry
    ),
    Scenario(
        "fair",
        "fair clients queue in acquire(timeout), each woken alone by the release before it: "
        "masters killed and paused (entries lost on one), pub/sub dropped, a queued process SIGSTOPped",
        faults=["kill_delayed", "pause_master", "kill_pubsub", "client_pause"],
        client_mode="fair",
        threads=2,
        processes=2,
        resources=1,
    ),
    Scenario(
        "reentrant",
        "reentrant clients entering 2-3 deep: masters killed and paused, a holder SIGSTOPped",
        faults=["kill_delayed", "pause_master", "client_pause"],
        client_mode="reentrant",
        threads=2,
        processes=2,
        resources=1,
    ),
    Scenario(
        "celery",
        "RedlockTask in 2 prefork workers x 2 children: masters killed and "
        "paused, a worker child SIGSTOPped while holding",
        faults=["kill_delayed", "pause_master", "pause_worker_child"],
        celery_workers=2,
        threads=0,
        processes=0,
        hold=(0.3, 0.6),
        fenced=1,
    ),
    Scenario(
        "stale-writer-celery",
        "a RedlockTask's pool child SIGSTOPs itself after its last ensure() and before its write, "
        "past its validity, then writes: plain and fenced (lock_fenced=True) resources",
        faults=["stale_writer"],
        celery_workers=2,
        threads=0,
        processes=0,
        resources=1,
        fenced=1,
        ttl=0.5,
        hold=(0.3, 0.6),
        plain_lost="required",
        limit="as stale-writer: the heartbeat stops with the paused child, and nothing in the task "
        "can notice before the write; lock_fenced=True and a fenced resource refuse it",
    ),
]
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


@dataclass
class Result:
    scenario: Scenario
    duration: float
    seed: int
    report: Report
    events: list[dict[str, Any]]
    nemesis_log: list[str]
    fault_counts: dict[str, int]

    def problems(self) -> list[str]:
        """What this run failed to show, given what the scenario expects."""
        report, scenario = self.report, self.scenario
        found: list[str] = []
        if report.holds == 0:
            return ["no hold at all: the workload did not run"]
        if scenario.expect == "violation":
            if not report.overlaps:
                found.append("expected the checker to find an overlap; it found none")
            if scenario.fenced_expect == "safe":
                found += report.fence_problems()
        else:
            found += report.problems(plain_lost=scenario.plain_lost)
            bound = availability_bound(scenario)
            if scenario.available and report.max_unavailable > bound:
                found.append(
                    f"unavailable for {report.max_unavailable:.2f} s > {bound:.2f} s while a majority was up"
                )
        if scenario.faults and not self.fault_counts:
            found.append("no fault was injected")
        found += self._client_pause_problems()
        found += self._fence_problems()
        return found

    def _fence_problems(self) -> list[str]:
        """What the fenced resources and the stale writer must show (``report.problems()`` has
        already judged the fence checks for a scenario expected to be safe)."""
        report, scenario = self.report, self.scenario
        found: list[str] = []
        if scenario.fenced and not report.fenced_holds:
            found.append("no fenced hold at all: the fenced resource was never taken")
        if scenario.fenced_expect == "required" and not report.fence_violations:
            found.append("expected the fence check to find a fence gone backwards; it found none")
        if scenario.plain_lost == "required" and not report.lost_updates:
            found.append("expected lost updates on the plain resource (a stale write); found none")
        if "stale_writer" in scenario.faults:
            written = {e["token"] for e in self.events if e["kind"] == "stale-write"}
            found += [
                f"{e['client']} paused as a stale writer and never wrote"
                for e in self.events
                if e["kind"] == "stale-paused" and e["token"] not in written
            ]
            if scenario.fenced and not report.stale_fenced_refused:
                found.append("expected stale writes refused by the fenced resource; found none")
        return found

    def _client_pause_problems(self) -> list[str]:
        found = []
        resumed = {e["token"]: e for e in self.events if e["kind"] in ("resumed", "checked")}
        for event in self.events:
            if event["kind"] != "paused":
                continue
            after = resumed.get(event["token"])
            if after is None:
                found.append(f"{event['client']} was paused and never reported resuming")
                continue
            if after["owned"] or not after["ensure_raised"].startswith("LockLost"):
                found.append(
                    f"{event['client']} resumed with owned()={after['owned']}, "
                    f"ensure() raised {after['ensure_raised'] or 'nothing'}"
                )
            others = [
                h
                for h in self.report_holds
                if h["resource"] == event["resource"]
                and h["client"] != event["client"]
                and event["t"] < h["t_acquired"] < after["t"]
            ]
            if not others:
                found.append(f"nobody took {event['resource']} while {event['client']} was paused")
        return found

    report_holds: list[dict[str, Any]] = field(default_factory=list)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def availability_bound(scenario: Scenario) -> float:
    """A lock abandoned by a crashed (or paused) holder is free again one TTL later; allow one more
    TTL for rounds that split the votes, and the reconnect backoff's cap plus a connect for a
    master that came back (masters.BACKOFF_CAP). A contended RedlockTask run is not retried at once
    but republished with a countdown (at most redlock_retry_backoff_max, 0.3 s in celery_app) that
    a worker's timer then waits out: allow a second more for that path through the broker."""
    bound = 2 * scenario.ttl + BACKOFF_CAP + 0.1
    if scenario.celery_workers:
        bound += 0.3 + 1.0
    return bound


def _package_root() -> Path:
    """The directory from which ``<this package>.client`` imports, for client processes."""
    depth = len(__package__.split("."))
    return Path(__file__).resolve().parents[depth]


def run_scenario(scenario: Scenario, duration: float, seed: int) -> Result:
    rng = random.Random(f"{seed}:{scenario.name}")
    with Cluster(scenario.cluster) as cluster, contextlib.ExitStack() as stack:
        register = Register(cluster.register.url)
        nemesis = Nemesis(cluster, Register(cluster.register.url), random.Random(rng.random()), scenario.ttl)
        stack.callback(nemesis.register.close)
        stack.callback(nemesis.stop.set)
        plain = [f"res{i}" for i in range(scenario.resources)]
        fenced = [f"{FENCED_PREFIX}{i}" for i in range(scenario.fenced)]
        resources = plain + fenced
        if "stale_writer" in scenario.faults:
            counts = (
                ("thread", scenario.threads),
                ("process", scenario.processes),
                ("child", scenario.celery_workers),
            )
            kinds = [kind for kind, count in counts if count]
            classes = [c for c, n in (("plain", plain), ("fenced", fenced)) if n]
            # In turn, both kinds on both classes: (thread, plain), (process, fenced), ...
            nemesis.stale_targets = [
                (kinds[(turn + j) % len(kinds)], resource_class)
                for turn in range(len(kinds))
                for j, resource_class in enumerate(classes)
            ]
        key_prefix = f"faults:{scenario.name}:"
        broker = cluster.register.url.rsplit("/", 1)[0] + "/1"
        queue = f"faults-{uuid.uuid4().hex[:8]}"
        if scenario.celery_workers:
            nemesis.workers = stack.enter_context(
                celery_workers(
                    scenario.celery_workers,
                    package=__package__,
                    root=_package_root(),
                    broker=broker,
                    register=cluster.register.url,
                    masters=cluster.urls(0),
                    ttl=scenario.ttl,
                    key_prefix=key_prefix,
                    queue=queue,
                    stale="stale_writer" in scenario.faults,
                )
            )
        until = time.monotonic() + duration
        configs = []
        for group in range(scenario.cluster.groups):
            for kind, count in (("t", scenario.threads), ("p", scenario.processes)):
                for i in range(count):
                    configs.append(
                        ClientConfig(
                            name=f"g{group}{kind}{i}",
                            masters=cluster.urls(group),
                            register=cluster.register.url,
                            resources=resources,
                            until=until,
                            seed=rng.randrange(2**32),
                            ttl=scenario.ttl,
                            hold=scenario.hold,
                            abandon=scenario.abandon,
                            extend=scenario.extend,
                            key_prefix=key_prefix,
                            pausable=kind == "p",
                            extra={"mode": scenario.client_mode, "stale": "stale_writer" in scenario.faults},
                        )
                    )
        processes: dict[str, subprocess.Popen[bytes]] = {}
        threads: list[threading.Thread] = []
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(_package_root()), os.environ.get("PYTHONPATH", "")])
        )
        try:
            for config in configs:
                if config.pausable:
                    processes[config.name] = subprocess.Popen(
                        [sys.executable, "-m", f"{__package__}.client", config.to_json()], env=env
                    )
                else:
                    thread = threading.Thread(target=run_client, args=(config,), name=config.name)
                    thread.start()
                    threads.append(thread)
            nemesis.pids = {name: proc.pid for name, proc in processes.items()}
            nemesis_thread = None
            if scenario.faults:
                nemesis_thread = threading.Thread(
                    target=nemesis.run,
                    args=(scenario.faults, until),
                    kwargs={"victims": scenario.victims, "concurrent": scenario.concurrent},
                    name="nemesis",
                )
                nemesis_thread.start()
            if scenario.celery_workers:
                produce(
                    broker,
                    queue,
                    register,
                    resources,
                    scenario.hold,
                    scenario.ttl,
                    until,
                    rng,
                    outstanding=4 * scenario.celery_workers * CONCURRENCY,
                )
            for thread in threads:
                thread.join(duration + 30)
            for proc in processes.values():
                proc.wait(timeout=max(1.0, until - time.monotonic()) + 30)
            if nemesis_thread is not None:
                nemesis.stop.set()
                nemesis_thread.join(60)
        finally:
            nemesis.stop.set()
            for proc in processes.values():
                if proc.poll() is None:  # ours, by pid: resume (it may be stopped) and kill
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                    proc.wait(10)
        stack.close()  # workers stop first (warm shutdown: running bodies finish and record)
        records = register.records()
        failures = register.client.hgetall(CELERY_FAILURES)
        if failures:
            records.append(
                {
                    "kind": "summary",
                    "client": "celery",
                    "failures": {_text(k): int(v) for k, v in failures.items()},
                }
            )
        logs = {r: [value for value, _ in register.log(r)] for r in plain}
        fenced_logs = {r: [(value, fence or 0) for value, _, fence in register.fenced_log(r)] for r in fenced}
        refused = {r: register.refused(r) for r in fenced}
        counters = {r: register.read(r) for r in resources}
        events = register.records(EVENTS)
        register.close()
    report = check(records, logs, counters, fenced_logs=fenced_logs, refused=refused, events=events)
    result = Result(scenario, duration, seed, report, events, nemesis.log, dict(nemesis.counts))
    result.report_holds = [r for r in records if r["kind"] == "hold"]
    unfinished = [t.name for t in threads if t.is_alive()]
    if unfinished:
        raise RuntimeError(f"clients did not finish: {unfinished}")
    return result
