"""Handoff latency: how soon a waiting client gets a lock after its holder releases it.

Run:  python benchmarks/bench_wait.py [--masters 5] [--handoffs 300] [--retry-delay 0.2]

Two processes pass one lock back and forth over N loopback masters (started here, stopped at the
end). Each in turn: ``acquire(timeout=10)`` begun while the other holds the lock, hold 30 ms,
``release(linger=False)``; so every acquisition waits for the other's release. A *handoff*
is the time from one process's ``release()`` returning to the other's ``acquire()`` returning
(``CLOCK_MONOTONIC``, system-wide on Linux, so comparable across the two processes).

Two modes, run one after the other with the same masters: ``wait="release"`` (the waiter is woken
by the release's publish; see ``celery_redlock.lock.subscriber``) and ``wait="poll"`` (the waiter
tries again after a random delay in ``[0, retry_delay)``, as every Python Redlock client does).
The goal: release p50 under 2 ms, at least 20x better than polling.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

HOLD = 0.03


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def client(urls: list[str], mode: str, retry_delay: float, rounds: int, me: int, turn: Any, out: Any) -> None:
    """Acquire only once the other process holds the lock (``turn`` counts acquisitions), so
    every acquire waits for a release of the other's, which comes ``HOLD`` later."""
    events: list[tuple[str, float]] = []
    with Redlock(urls, wait=mode, retry_delay=retry_delay, request_timeout=0.2) as redlock:
        lock = redlock.lock("bench:handoff", ttl=10)
        expected = me
        for _ in range(rounds):
            deadline = time.monotonic() + 30
            while turn.value < expected and time.monotonic() < deadline:
                time.sleep(0.0005)
            if not lock.acquire(timeout=10):
                break
            events.append(("acquired", now()))
            with turn.get_lock():
                turn.value += 1
            expected = turn.value + 1  # after the other's next acquisition
            time.sleep(HOLD)
            lock.release(linger=False)
            events.append(("released", now()))
    out.put(events)


def handoffs(runs: list[list[tuple[str, float]]]) -> list[float]:
    """Each acquisition that follows the *other* process's release, in milliseconds."""
    tagged = sorted((t, kind, who) for who, events in enumerate(runs) for kind, t in events)
    result = []
    last_release: tuple[float, int] | None = None
    for t, kind, who in tagged:
        if kind == "released":
            last_release = (t, who)
        elif last_release is not None and last_release[1] != who:
            result.append((t - last_release[0]) * 1000)
            last_release = None
    return result


def measure(urls: list[str], mode: str, retry_delay: float, count: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    turn, out = ctx.Value("i", 0), ctx.Queue()
    rounds = count // 2 + 1
    procs = [
        ctx.Process(target=client, args=(urls, mode, retry_delay, rounds, me, turn, out)) for me in range(2)
    ]
    for proc in procs:
        proc.start()
    runs = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return handoffs(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masters", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=300)
    parser.add_argument("--retry-delay", type=float, default=0.2, help="Redlock's default")
    args = parser.parse_args()
    with ServerSet(args.masters) as servers:
        rows = []
        for mode in ("release", "poll"):
            times = sorted(measure(servers.urls, mode, args.retry_delay, args.handoffs))
            p50 = statistics.median(times)
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            rows.append((mode, len(times), p50, p99))
    print(f"Handoff over N={args.masters} masters, two processes, retry_delay={args.retry_delay}")
    print("| wait | handoffs | p50 ms | p99 ms | p50 poll / p50 |")
    print("|---|--:|--:|--:|--:|")
    poll_p50 = rows[1][2]
    for mode, n, p50, p99 in rows:
        print(f"| {mode} | {n} | {p50:.2f} | {p99:.2f} | {poll_p50 / p50:.1f}x |")


if __name__ == "__main__":
    main()
