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
The goal with fair: under 1.5 attempts per grant (here: wake attempts), no starvation.
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


def order_under(servers: ServerSet, condition: str, waiters: int = 10) -> tuple[list[int], float]:
    """``waiters`` fair waiters arrive one after another (each queued on every answering master
    before the next); ``condition`` disturbs the masters; then the holder releases. Returns the
    grant order (arrival indexes) and the seconds from the release to the last grant."""
    name = f"bench:order:{condition}"
    order: list[int] = []
    mutex = threading.Lock()
    with Redlock(servers.urls, request_timeout=0.2, wait_poll=0.5) as redlock:
        holder = redlock.lock(name, ttl=30, fair=True)
        assert holder.acquire(blocking=False)

        def run(i: int) -> None:
            lock = redlock.lock(name, ttl=30, fair=True)
            if lock.acquire(timeout=60):
                with mutex:
                    order.append(i)
                time.sleep(HOLD)
                lock.release(linger=False)

        def queued() -> set[int]:
            counts = set()
            for server in servers:
                if server.running and not server.paused:
                    counts.add(server.client().zcard("redlock:" + name + "~queue"))
            return counts

        if condition == "paused during arrivals":
            servers[0].pause()
        threads = []
        for i in range(waiters):
            threads.append(threading.Thread(target=run, args=(i,)))
            threads[-1].start()
            deadline = time.monotonic() + 10
            while queued() != {i + 1} and time.monotonic() < deadline:
                time.sleep(0.005)
        if condition == "paused during arrivals":
            servers[0].resume()
        elif condition == "one master emptied":
            servers[0].flushall()
        released = time.monotonic()
        holder.release(linger=False)
        for thread in threads:
            thread.join(90)
        return order, time.monotonic() - released


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
        print("\nfair order when the masters disagree (10 waiters, arrival order 0..9):")
        for condition in ("healthy", "one master emptied", "paused during arrivals"):
            order, drain = order_under(servers, condition)
            inversions = sum(1 for i, a in enumerate(order) for b in order[i + 1 :] if a > b)
            print(f"  {condition:<24} granted {len(order)}/10, {inversions} inversions, drain {drain:.2f} s")


if __name__ == "__main__":
    main()
