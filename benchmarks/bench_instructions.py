"""Instructions one run of a no-op task costs in Celery's tracer: plain, floor, core and locked.

Run:  python benchmarks/bench_instructions.py [--runs 400] [--masters 5] [--kinds plain,floor,core,locked]

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
- ``core``: ``Redlock.lock(...).acquire(blocking=False)`` before the body and ``release()`` as it
  ends, in a task base of a few lines: the lock core without the Celery layer;
- ``locked``: ``RedlockTask`` with ``lock_key="bench:<i>"``, as ``bench_celery.py``'s.

How only the runs are counted: callgrind switches collection on and off only at C functions
(``--toggle-collect``), so the ``--runs`` measured runs are made from inside ``functools.reduce``,
a C function nothing else in the process calls while they run; start-up, imports and 50 warm-up
runs are not counted. Each process gets ``PYTHONHASHSEED=0``, so its dicts are laid out the same
way each time. Needs ``valgrind`` (Debian: ``apt-get install valgrind``); a run of 400 tasks per
kind takes about 30 s a kind, two kinds at a time.
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
KINDS = ("plain", "floor", "core", "locked")
WARMUP = 50
COLLECTED = re.compile(r"Collected : (\d+)")


def child(kind: str, runs: int) -> None:
    """Under callgrind: ``runs`` runs of ``kind`` through Celery's tracer, inside functools.reduce."""
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

    @app.task(name="bench.plain")
    def plain(i: int) -> int:
        return i

    @app.task(base=FloorTask, name="bench.floor")
    def floor(i: int) -> int:
        return i

    @app.task(base=CoreTask, name="bench.core")
    def core(i: int) -> int:
        return i

    @app.task(base=RedlockTask, lock_key="bench:<i>", name="bench.locked")
    def locked(i: int) -> int:
        return i

    app.finalize()
    task = {"plain": plain, "floor": floor, "core": core, "locked": locked}[kind]
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
    done = functools.reduce(one, range(runs), 0)  # the counted part: see the module docstring
    assert done == runs
    core_redlock.close()


def count(valgrind: str, kind: str, runs: int, masters: str) -> int:
    """Instructions per run of ``kind``, from one process under callgrind."""
    env = dict(os.environ, PYTHONHASHSEED="0", BENCH_MASTERS=masters)
    proc = subprocess.run(
        [
            valgrind,
            "--tool=callgrind",
            "--toggle-collect=functools_reduce",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            __file__,
            "--child",
            kind,
            "--runs",
            str(runs),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    found = COLLECTED.findall(proc.stderr)
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{kind}: callgrind run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return int(found[-1]) // runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400, help="counted runs per kind")
    parser.add_argument("--masters", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.runs)
        return
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit("bench_instructions needs valgrind (Debian: apt-get install valgrind)")
    kinds = args.kinds.split(",")
    from celery_redlock.testing import ServerSet

    with ServerSet(args.masters) as masters, ThreadPoolExecutor(2) as pool:
        urls = ",".join(masters.urls)
        counted = dict(
            zip(kinds, pool.map(lambda k: count(valgrind, k, args.runs, urls), kinds), strict=True)
        )
    print(
        f"instructions per run of a no-op task through Celery's tracer, {args.masters} masters, "
        f"{args.runs} counted runs per kind, python {sys.version.split()[0]}"
    )
    print("| kind | instructions | over plain | over the kind before |")
    print("|---|--:|--:|--:|")
    before = None
    for kind in kinds:
        value = counted[kind]
        over_plain = f"{value - counted['plain']:+,}" if "plain" in counted else ""
        over_before = f"{value - before:+,}" if before is not None else ""
        print(f"| {kind} | {value:,} | {over_plain} | {over_before} |")
        before = value
    if "floor" in counted and "locked" in counted:
        print(f"locked / floor: {counted['locked'] / counted['floor']:.3f} (instructions; lower is better)")


if __name__ == "__main__":
    main()
