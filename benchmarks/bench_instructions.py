"""Instructions one run of a no-op task costs in Celery's tracer: plain, floor, core and locked.

Run:  python benchmarks/bench_instructions.py [--runs 400] [--masters 5]
                                             [--kinds plain,floor,rounds,core,locked] [--cold]

Throughput benchmarks (``bench_celery.py``) move by a few per cent from one run to the next on a
shared machine, which is the size of what a change to the locked run's code saves. This one
counts, with valgrind's callgrind, the machine instructions the worker's own process executes
for one run, which is the same from one run to the next within about 0.1 %: a change of a
thousand instructions per run (a quarter of a microsecond) is a number, not noise. It counts
user-space instructions only: the system calls' kernel time, the masters' work and the waits
are not in it (``bench_celery.py`` has those).

Each kind is a task of one app, called through Celery's own tracer (``build_tracer``, what a
worker calls for each message) in a process under callgrind, against ``--masters`` real masters
on loopback started here; results go to an in-memory backend:

- ``plain``: ``@app.task``, no lock;
- ``floor``: ``floortask.FloorTask``, the raw commands ``bench_celery.py`` measures against;
- ``rounds``: ``Redlock.try_acquire`` before the body and ``Redlock.release_key`` as it ends: the
  library's rounds (transport, votes, validity) without a Lock object;
- ``core``: ``Redlock.lock(...).acquire(blocking=False)`` before the body and ``release()`` as it
  ends, in a task base of a few lines: the lock core without the Celery layer;
- ``locked``: ``RedlockTask`` with ``lock_key="bench:<i>"``, as ``bench_celery.py``'s.

How only the runs are counted: callgrind switches collection on and off only at C functions
(``--toggle-collect``), so the ``--runs`` measured runs are made from inside ``functools.reduce``,
a C function nothing else in the process calls while they run; start-up, imports and 50 warm-up
runs are not counted. Each process gets ``PYTHONHASHSEED=0``, so its dicts are laid out the same
way each time. Needs ``valgrind`` (Debian: ``apt-get install valgrind``); a run of 400 tasks per
kind takes about 30 s a kind, two kinds at a time.

``--cold`` also simulates the caches (callgrind's ``--cache-sim``, a last-level cache of 8 MiB)
and empties them before every counted run, by writing 16 MiB outside the counted part: what a run
costs when everything it touches must come from memory again, as in a busy worker whose other
work (the consumer, the broker's client, the other processes on its cores) has evicted it. It
prints the misses and callgrind's cycle estimate (instructions + 10 per first-level miss + 100
per last-level miss) beside the instructions. The estimate is an upper bound (a real worker
keeps some of it cached) that counts what instruction counts cannot: code and objects spread
over more places cost misses, not only instructions.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # floortask.py and floor.py are imported from here
KINDS = ("plain", "floor", "rounds", "core", "locked")
WARMUP = 50
COLLECTED = re.compile(r"Collected : ([\d ]+)")
EVENTS = re.compile(r"Events *: ([\w ]+)")
# The simulated last-level cache, and what empties it (written between counted runs).
LAST_LEVEL = "--LL=8388608,16,64"
EVICT_BYTES = 16 * 1024 * 1024


def child(kind: str, runs: int, cold: bool) -> None:
    """Under callgrind: ``runs`` runs of ``kind`` through Celery's tracer, inside functools.reduce
    (``cold``: each in a reduce of its own, after emptying the caches outside it)."""
    from celery import Celery, Task
    from celery.app.trace import build_tracer

    from celery_redlock import Redlock, RedlockTask

    sys.path.insert(0, str(HERE))
    from floortask import FloorTask

    urls = os.environ["BENCH_MASTERS"].split(",")
    app = Celery("bench-instructions", broker="memory://", backend="cache+memory://")
    app.conf.update(redlock_masters=urls)
    core_redlock = Redlock(urls)

    class CoreTask(Task):  # type: ignore[misc]
        abstract = True

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            lock = core_redlock.lock(f"core:{args[0]}", 30.0)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"core: {lock.name} not acquired")
            self.request.core_lock = lock

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return self.run(*args, **kwargs)
            finally:
                self.request.core_lock.release()

    class RoundsTask(Task):  # type: ignore[misc]
        abstract = True

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            key, token = f"rounds:{args[0]}", os.urandom(20).hex()
            if core_redlock.try_acquire(key, token, 30.0)[0] <= 0:
                raise RuntimeError(f"rounds: {key} not acquired")
            self.request.rounds_lock = (key, token)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return self.run(*args, **kwargs)
            finally:
                core_redlock.release_key(*self.request.rounds_lock)

    @app.task(name="bench.plain")
    def plain(i: int) -> int:
        return i

    @app.task(base=FloorTask, name="bench.floor")
    def floor(i: int) -> int:
        return i

    @app.task(base=RoundsTask, name="bench.rounds")
    def rounds(i: int) -> int:
        return i

    @app.task(base=CoreTask, name="bench.core")
    def core(i: int) -> int:
        return i

    @app.task(base=RedlockTask, lock_key="bench:<i>", name="bench.locked")
    def locked(i: int) -> int:
        return i

    app.finalize()
    task = {"plain": plain, "floor": floor, "rounds": rounds, "core": core, "locked": locked}[kind]
    trace = build_tracer(task.name, task, app=app, hostname="bench@instructions", eager=False)
    first = time.time_ns() // 1000  # fresh keys on masters that other runs used

    def one(count: int, i: int) -> int:
        task_id = str(uuid.uuid4())
        trace(
            task_id, (first + i,), {}, {"id": task_id, "task": task.name, "delivery_info": {}, "headers": {}}
        )
        return count + 1

    for i in range(WARMUP):
        one(0, -1 - i)
    if cold:
        evict = bytearray(EVICT_BYTES)
        zeros = bytes(EVICT_BYTES)
        done = 0
        for i in range(runs):
            evict[:] = zeros  # not counted: outside functools.reduce
            done = functools.reduce(one, [i], done)
    else:
        done = functools.reduce(one, range(runs), 0)  # the counted part: see the module docstring
    assert done == runs
    core_redlock.close()


def count(valgrind: str, kind: str, runs: int, masters: str, cold: bool) -> dict[str, float]:
    """Callgrind's events per run of ``kind`` (``Ir``: instructions; with ``cold``, the cache
    misses too), from one process under callgrind."""
    env = dict(os.environ, PYTHONHASHSEED="0", BENCH_MASTERS=masters)
    caches = ["--cache-sim=yes", LAST_LEVEL] if cold else []
    proc = subprocess.run(
        [
            valgrind,
            "--tool=callgrind",
            *caches,
            "--toggle-collect=functools_reduce",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--child",
            kind,
            "--runs",
            str(runs),
            *(["--cold"] if cold else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    found = COLLECTED.findall(proc.stderr)
    names = EVENTS.findall(proc.stderr)
    if proc.returncode != 0 or not found or not names:
        raise RuntimeError(f"{kind}: callgrind run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {name: int(value) / runs for name, value in zip(names[-1].split(), found[-1].split(), strict=True)}


def cycle_estimate(events: dict[str, float]) -> float:
    """Callgrind's cycle estimate: an instruction a cycle, a first-level miss 10, a last-level
    miss 100."""
    first = events["I1mr"] + events["D1mr"] + events["D1mw"]
    last = events["ILmr"] + events["DLmr"] + events["DLmw"]
    return events["Ir"] + 10 * first + 100 * last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400, help="counted runs per kind")
    parser.add_argument("--masters", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--cold", action="store_true", help="simulate the caches, emptied before each run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.runs, args.cold)
        return
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("bench_instructions needs valgrind (Debian: apt-get install valgrind)")
    kinds = args.kinds.split(",")
    from celery_redlock.testing import ServerSet

    with ServerSet(args.masters) as masters, ThreadPoolExecutor(2) as pool:
        urls = ",".join(masters.urls)
        counted = dict(
            zip(kinds, pool.map(lambda k: count(valgrind, k, args.runs, urls, args.cold), kinds), strict=True)
        )
    print(
        f"per run of a no-op task through Celery's tracer, {args.masters} masters, {args.runs} counted "
        f"runs per kind{', caches emptied before each' if args.cold else ''}, python {sys.version.split()[0]}"
    )
    if args.cold:
        table(kinds, {kind: cycle_estimate(events) for kind, events in counted.items()}, counted)
    else:
        table(kinds, {kind: events["Ir"] for kind, events in counted.items()}, counted)


def table(kinds: list[str], cost: dict[str, float], counted: dict[str, dict[str, float]]) -> None:
    """One row per kind: ``cost`` (instructions, or the cycle estimate) with what it adds."""
    cold = "I1mr" in counted[kinds[0]]
    measure = "cycle estimate" if cold else "instructions"
    misses = " first-level misses | last-level misses |" if cold else ""
    print(
        f"| kind |{' instructions |' if cold else ''}{misses} {measure} | over plain | over the kind before |"
    )
    print("|---|--:|--:|--:|" + ("--:|--:|--:|" if cold else ""))
    before = None
    for kind in kinds:
        events, value = counted[kind], cost[kind]
        over_plain = f"{value - cost['plain']:+,.0f}" if "plain" in cost else ""
        over_before = f"{value - before:+,.0f}" if before is not None else ""
        extra = ""
        if cold:
            first = events["I1mr"] + events["D1mr"] + events["D1mw"]
            last = events["ILmr"] + events["DLmr"] + events["DLmw"]
            extra = f" {events['Ir']:,.0f} | {first:,.0f} | {last:,.0f} |"
        print(f"| {kind} |{extra} {value:,.0f} | {over_plain} | {over_before} |")
        before = value
    if "floor" in cost and "locked" in cost:
        print(f"locked / floor: {cost['locked'] / cost['floor']:.3f} ({measure}; lower is better)")


if __name__ == "__main__":
    main()
