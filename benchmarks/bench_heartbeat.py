"""How many locks one process's heartbeat keeps alive, against the round trip to the masters.

Run:  python benchmarks/bench_heartbeat.py [--masters 3] [--rtt 0,5,20] [--locks 10,100,1000,10000]
                                           [--ttl 1.5] [--duration 3]

The script starts its own masters (``celery_redlock.testing.ServerSet``) and one loopback proxy
per master (``celery_redlock.testing.ProxySet``), which adds half of each ``--rtt`` (ms) to every
byte in each direction. For each round trip and each lock count, one process acquires that many
locks with ``--ttl`` (before the delay is switched on, so acquiring is quick), hands them all to
one :class:`~celery_redlock.lock.heartbeat.Heartbeat` (extended every ttl / 3), switches the
delay on and watches for ``--duration`` seconds: a lock is *lost* when its ``on_lost`` fires or
it is not owned at some check (every 50 ms). ``min validity`` is the least validity any lock had
left at a check: how close the heartbeat came to losing one. ``cpu %`` is this process's CPU time
over the run (the heartbeat and the checks; the proxies run in the same process).

The summary gives, per round trip, the largest lock count kept with no loss. A run of the default
grid takes about a minute.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from celery_redlock import Lock, Redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.testing import ProxySet, ServerSet

CHECK_EVERY = 0.05


@dataclass
class Result:
    rtt_ms: float
    locks: int
    lost: int
    min_validity: float
    cpu: float


def run(
    servers: ServerSet, proxies: ProxySet, rtt_ms: float, count: int, ttl: float, duration: float
) -> Result:
    for server in servers:
        server.flushall()
    # request_timeout well above the round trip: what is measured is keeping up, not timeouts.
    with Redlock(proxies.urls, request_timeout=max(0.1, 5 * rtt_ms / 1000), retry_count=0) as rl:
        locks = [rl.lock(f"bench:heartbeat:{n}", ttl=ttl) for n in range(count)]
        lost: set[str] = set()
        mutex = threading.Lock()

        def on_lost(lock: Lock, reason: str) -> None:
            with mutex:
                lost.add(lock.name)

        heartbeat = Heartbeat(name="bench-heartbeat")
        try:
            # Each lock is kept as soon as it is acquired, as a worker does: acquiring thousands
            # takes longer than a TTL, and their due times spread over the interval.
            for lock in locks:
                if not lock.acquire(blocking=False):
                    raise RuntimeError(f"could not acquire {lock.name}: {lock.last_error}")
                heartbeat.keep(lock, on_lost=on_lost)
            for proxy in proxies:
                proxy.delay(rtt_ms / 2000, "both")
            cpu0 = time.process_time()
            started = time.monotonic()
            least = ttl
            while time.monotonic() - started < duration:
                time.sleep(CHECK_EVERY)
                validities = [lock.validity for lock in locks]
                least = min(least, *validities)
                with mutex:
                    lost.update(lock.name for lock, v in zip(locks, validities, strict=True) if v <= 0)
            cpu = (time.process_time() - cpu0) / (time.monotonic() - started)
        finally:
            heartbeat.stop()
            proxies.heal()
        for lock in locks:
            lock.release()
    return Result(rtt_ms, count, len(lost), least, cpu)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--masters", type=int, default=3, help="number of masters")
    parser.add_argument("--rtt", default="0,5,20", help="round trips to run, ms, e.g. 0,5,20")
    parser.add_argument("--locks", default="10,100,1000,10000", help="lock counts to run, e.g. 10,100,1000")
    parser.add_argument("--ttl", type=float, default=1.5, help="each lock's TTL, seconds")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds watched per run")
    args = parser.parse_args(argv)
    # Losses are counted here; the heartbeat's own line per lost lock would bury the table.
    logging.getLogger("celery_redlock.heartbeat").setLevel(logging.CRITICAL)
    try:
        rtts = [float(n) for n in args.rtt.split(",") if n.strip()]
        counts = [int(n) for n in args.locks.split(",") if n.strip()]
    except ValueError:
        parser.error("--rtt and --locks: expected comma-separated numbers")
    if not rtts or not counts or min(rtts) < 0 or min(counts) < 1 or args.masters < 1:
        parser.error("--rtt must be >= 0, --locks and --masters >= 1")
    if args.ttl <= 0 or args.duration <= 0:
        parser.error("--ttl and --duration must be > 0")

    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    results: list[Result] = []
    with (
        ServerSet(args.masters) as servers,
        ProxySet(server.address for server in servers) as proxies,
    ):
        print(f"masters: {args.masters} x {servers[0].binary}")
        for rtt in rtts:
            for count in sorted(counts):
                result = run(servers, proxies, rtt, count, args.ttl, args.duration)
                results.append(result)
                print(
                    f"  rtt {rtt:g} ms, {count} locks: {result.lost} lost, "
                    f"min validity {result.min_validity:.3f} s",
                    flush=True,
                )

    print(
        f"\nHeartbeat, {args.masters} masters, TTL {args.ttl:g} s (extended every {args.ttl / 3:.2f} s), "
        f"{args.duration:g} s per run"
    )
    print("| RTT ms | locks | lost | min validity s | cpu % |")
    print("|-------:|------:|-----:|---------------:|------:|")
    for r in results:
        print(f"| {r.rtt_ms:6g} | {r.locks:5d} | {r.lost:4d} | {r.min_validity:14.3f} | {r.cpu * 100:5.0f} |")
    print("\nLocks kept alive with no loss, per round trip (largest count tried):")
    for rtt in rtts:
        kept = [r.locks for r in results if r.rtt_ms == rtt and r.lost == 0]
        print(f"  RTT {rtt:g} ms: {max(kept) if kept else 0}")
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
