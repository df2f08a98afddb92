"""Herd: 20 waiters on one resource, each holding it briefly; attempts per grant, plain vs fair.

Run:  python benchmarks/bench_herd.py [--masters 5] [--grants 10] [--layouts 4x5,20x1]

Each waiter loops ``--grants`` times: ``acquire(timeout=30)``, hold 1 ms, ``release(linger=False)``,
so all 20 wait for every release. A layout PxT runs P processes of T threads; each process has
its own Redlock (one subscriber, shared by its threads). Same masters, same run, plain locks
then ``fair=True``.

Reported per mode: attempts per grant (every attempt of every acquire call), *wake* attempts per
grant (beyond the two every contended call makes on arrival: the first try, and the one right
after joining the release channel or the queue), p50/p99/longest wait per acquire call, and the
fewest grants any waiter got within its calls (starvation shows as a waiter timing out).
Issue 16's goal with fair: under 1.5 attempts per grant (here: wake attempts), no starvation.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from typing import Any

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

HOLD = 0.001


def waiter_process(urls: list[str], fair: bool, threads: int, grants: int, start: Any, out: Any) -> None:
    results: list[tuple[int, float, bool]] = []  # (attempts, waited, granted) per acquire call
    mutex = threading.Lock()
    with Redlock(urls, request_timeout=0.2) as redlock:

        def run() -> None:
            lock = redlock.lock("bench:herd", ttl=10, fair=fair)
            start.wait()
            for _ in range(grants):
                began = time.monotonic()
                granted = lock.acquire(timeout=30)
                waited = time.monotonic() - began
                with mutex:
                    results.append((lock.last_attempts, waited, granted))
                if granted:
                    time.sleep(HOLD)
                    lock.release(linger=False)

        workers = [threading.Thread(target=run) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    out.put(results)


def measure(urls: list[str], fair: bool, processes: int, threads: int, grants: int) -> dict[str, float]:
    context = multiprocessing.get_context("fork")
    start = context.Barrier(processes)
    out = context.Queue()
    children = [
        context.Process(target=waiter_process, args=(urls, fair, threads, grants, start, out))
        for _ in range(processes)
    ]
    began = time.monotonic()
    for child in children:
        child.start()
    results = [row for _ in children for row in out.get(timeout=600)]
    for child in children:
        child.join(60)
    elapsed = time.monotonic() - began
    granted = [r for r in results if r[2]]
    waits = sorted(r[1] for r in results)
    attempts = sum(r[0] for r in results)
    wake = sum(max(0, r[0] - 2) for r in results)
    return {
        "grants": len(granted),
        "timeouts": len(results) - len(granted),
        "attempts/grant": attempts / max(1, len(granted)),
        "wake attempts/grant": wake / max(1, len(granted)),
        "wait p50 ms": statistics.median(waits) * 1000,
        "wait p99 ms": waits[int(0.99 * (len(waits) - 1))] * 1000,
        "longest wait ms": waits[-1] * 1000,
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masters", type=int, default=5)
    parser.add_argument("--grants", type=int, default=10, help="acquisitions per waiter")
    parser.add_argument("--layouts", default="4x5,20x1", help="processes x threads, comma-separated")
    args = parser.parse_args()
    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts.split(",")]
    with ServerSet(args.masters) as servers:
        for processes, threads in layouts:
            print(f"\n{processes} processes x {threads} threads, {args.grants} grants each, N={args.masters}")
            rows = {
                mode: measure(servers.urls, mode == "fair", processes, threads, args.grants)
                for mode in ("plain", "fair")
            }
            for field in rows["plain"]:
                print(
                    f"  {field:<22} plain {rows['plain'][field]:>10.2f}   fair {rows['fair'][field]:>10.2f}"
                )


if __name__ == "__main__":
    main()
