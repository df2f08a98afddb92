"""Redlock's cost over N loopback masters, against the floor of the same commands with no lock logic.

Run:  python benchmarks/bench_lock.py [--masters 1,3,5] [--iterations 3000] [--duration 10]
                                      [--processes 8] [--skip-degraded] [--transports fast,redis-py]
      python benchmarks/bench_lock.py --async ...   (AsyncRedlock: see bench_async.py)

The script starts its own masters (``celery_redlock.testing.ServerSet``; set
``CELERY_REDLOCK_SERVER_BIN`` to run another binary) and stops them when it ends.

Uncontended: one thread, one resource, ``acquire(blocking=False)`` then ``release()``, timed per
iteration. The *floor* is the least any client could do for the same lock: ``SET key token NX PX
ttl`` written to every master's socket and every reply read, then the release script (by
digest, EVALSHA, as the library sends every script) written to every socket and its replies
read (as Redlock's release does: it returns once the masters answered), over raw blocking
sockets with no parser beyond counting lines (``benchmarks/floor.py``). Redlock and
floor run in alternating blocks in the same process, so both see the same machine load; the
ratio is what the lock logic costs.

Contended: ``--processes`` processes loop on one resource; a critical section is one successful
acquisition followed by its release. The floor loop sends the same raw commands: SET NX PX to all
masters, a quorum of OKs is a hold, and the release script goes to every master whose SET
succeeded (after a hold: all of them). Every process runs both loops, each on its own key, in
alternating time slices (``--slice``) for ``--duration`` seconds each, so both see the same
machine load. A failed try is retried at once, or after the same random delay (``--retry-delay``)
for both.

Degraded: the uncontended Redlock loop at the largest N, over N running masters and over the same
masters with one of them stopped (its port refuses connections; it was up when the Redlock
connected, and killed after), in alternating blocks: what a dead master costs every lock.

Each Redlock row is run once per transport of ``--transports`` (default both): the fast one
(``transport="fast"``, the default) and the plain redis-py reference
(``lock/transport/reference.py``), side by side in the same blocks and slices, so that what the
fast transport's extra code buys is a number.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from floor import RawMasters

from celery_redlock import Redlock
from celery_redlock.lock.redlock import TRANSPORTS
from celery_redlock.testing import RedisServer, ServerSet

TTL = 10.0
# How long a contended run may overrun its duration before its processes are killed.
CONTENDED_GRACE = 30.0


# -- the floor: raw commands over raw sockets (benchmarks/floor.py) ------------------------------
TTL_MS = int(TTL * 1000)


def floor_try(floor: RawMasters, key: str) -> bool:
    """One contended attempt: a hold is a quorum of OKs, then released with its replies read (as
    Redlock's release); a failed attempt's OKs are retracted without waiting (as Redlock's)."""
    token = secrets.token_hex(20)
    won = floor.set_nx(key, token, TTL_MS)
    if len(won) >= floor.quorum:
        floor.release(key, token, won)
        return True
    if won:
        floor.retract(key, token, won)
    return False


# -- uncontended ----------------------------------------------------------------------------------
@dataclass
class Samples:
    name: str
    ns: list[int]

    def p(self, q: float) -> float:
        ordered = sorted(self.ns)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0

    @property
    def ops(self) -> float:
        return len(self.ns) / (sum(self.ns) / 1e9)


def redlock_step(redlock: Redlock, key: str, fenced: bool = False) -> Callable[[], None]:
    lock = redlock.lock(key, ttl=TTL, fenced=fenced)

    def step() -> None:
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"uncontended acquire failed: {lock.last_error}")
        lock.release()

    return step


def floor_step(floor: RawMasters, key: str) -> Callable[[], None]:
    def step() -> None:
        token = secrets.token_hex(20)
        granted = floor.set_nx(key, token, TTL_MS)
        if len(granted) != len(floor.socks):
            raise RuntimeError("uncontended floor SET NX was refused")
        floor.release(key, token, granted)

    return step


def run_block(step: Callable[[], None], count: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        step()
        into.append(clock() - t0)


def alternate(
    steps: dict[str, Callable[[], None]], iterations: int, warmup: int, block: int
) -> list[Samples]:
    """Each step timed ``iterations`` times after ``warmup``, in alternating blocks."""
    samples = {name: Samples(name, []) for name in steps}
    for step in steps.values():
        run_block(step, warmup, [])
    done = 0
    while done < iterations:
        count = min(block, iterations - done)
        # Alternate which goes first, so neither always follows the other's cache effects.
        order = list(steps) if (done // block) % 2 == 0 else list(reversed(steps))
        for name in order:
            run_block(steps[name], count, samples[name].ns)
        done += count
    return list(samples.values())


def impl(kind: str, transport: str, transports: Sequence[str]) -> str:
    """A row's name: the kind, and its transport when more than one is run."""
    return kind if len(transports) == 1 and transport == "fast" else f"{kind} ({transport})"


def uncontended(
    urls: Sequence[str], iterations: int, warmup: int, block: int, transports: Sequence[str]
) -> list[Samples]:
    """Plain and fenced (``fenced=True``: two rounds per grant) over each transport, and the raw
    floor (last), all alternating."""
    redlocks = {t: Redlock(urls, ttl=TTL, transport=t) for t in transports}
    floor = RawMasters(urls)
    try:
        steps: dict[str, Callable[[], None]] = {}
        for t, redlock in redlocks.items():
            steps[impl("redlock", t, transports)] = redlock_step(redlock, f"bench:uncontended:redlock:{t}")
            steps[impl("fenced", t, transports)] = redlock_step(
                redlock, f"bench:uncontended:fenced:{t}", fenced=True
            )
        steps["floor"] = floor_step(floor, "bench:uncontended:floor")
        return alternate(steps, iterations, warmup, block)
    finally:
        floor.close()
        for redlock in redlocks.values():
            redlock.close()


def degraded(
    urls: Sequence[str], iterations: int, warmup: int, block: int, transports: Sequence[str]
) -> list[tuple[Samples, Samples]]:
    """Per transport, the uncontended Redlock loop over ``urls``, and over the same masters but
    the last, whose place takes a master that is stopped after the Redlock has connected to it."""
    with RedisServer() as doomed:
        pairs = {
            t: (Redlock(urls, ttl=TTL, transport=t), Redlock([*urls[:-1], doomed.url], ttl=TTL, transport=t))
            for t in transports
        }
        try:
            steps: dict[str, Callable[[], None]] = {}
            for t, (healthy, hurt) in pairs.items():
                steps[impl("all up", t, transports)] = redlock_step(healthy, f"bench:degraded:healthy:{t}")
                steps[impl("one stopped", t, transports)] = redlock_step(hurt, f"bench:degraded:hurt:{t}")
            for step in steps.values():
                step()  # connected to every master while all are up
            doomed.kill()
            samples = alternate(steps, iterations, warmup, block)
            return [(samples[2 * k], samples[2 * k + 1]) for k in range(len(pairs))]
        finally:
            for healthy, hurt in pairs.values():
                hurt.close()
                healthy.close()


# -- contended ------------------------------------------------------------------------------------
def slice_kind(index: int, kinds: Sequence[str]) -> str:
    """Slices run A B B A A B B A ... (A B C C B A ... for three kinds): each kind goes first and
    last equally often, whatever the load does."""
    turn, place = divmod(index, len(kinds))
    return kinds[place if turn % 2 == 0 else len(kinds) - 1 - place]


def contender(
    urls: list[str],
    key: str,
    start_at: Any,
    ready: Any,
    results: Any,
    slices: int,
    slice_length: float,
    retry_delay: float,
    transports: Sequence[str],
) -> None:
    """One competing process: tries every kind (a Redlock per transport, and the floor), each
    during its own time slices.

    Every kind lives in every process and they alternate by the clock (CLOCK_MONOTONIC is shared
    by all processes), so they see the same machine load; each has its own key.
    """
    redlocks = [Redlock(urls, ttl=TTL, retry_count=0, transport=t) for t in transports]
    floor = RawMasters(urls)
    floor_key = f"{key}:floor"

    def redlock_try(redlock: Redlock, name: str) -> Callable[[], bool]:
        lock = redlock.lock(name, ttl=TTL)

        def attempt() -> bool:
            if lock.acquire(blocking=False):
                lock.release()
                return True
            return False

        return attempt

    tries: dict[str, Callable[[], bool]] = {
        impl("redlock", t, transports): redlock_try(r, f"{key}:redlock:{t}")
        for t, r in zip(transports, redlocks, strict=True)
    }
    tries["floor"] = lambda: floor_try(floor, floor_key)
    kinds = list(tries)
    holds = dict.fromkeys(kinds, 0)
    attempts = dict.fromkeys(kinds, 0)
    try:
        for attempt in tries.values():  # connect before the clock starts
            attempt()
        ready.put(os.getpid())
        if not start_at.wait(timeout=60):
            return
        t0 = start_at.value
        end = t0 + slices * slice_length
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if now < t0:
                time.sleep(t0 - now)
                continue
            kind = slice_kind(int((now - t0) / slice_length), kinds)
            attempts[kind] += 1
            if tries[kind]():
                holds[kind] += 1
            elif retry_delay > 0:
                time.sleep(random.uniform(0, retry_delay))
        results.put((os.getpid(), holds, attempts))
    finally:
        floor.close()
        for redlock in redlocks:
            redlock.close()


class StartSignal:
    """An event that also carries the monotonic time the contenders start at."""

    def __init__(self, ctx: Any) -> None:
        self.event = ctx.Event()
        self.t0 = ctx.Value("d", 0.0)

    def set(self, t0: float) -> None:
        self.t0.value = t0
        self.event.set()

    def wait(self, timeout: float) -> bool:
        return bool(self.event.wait(timeout))

    @property
    def value(self) -> float:
        return float(self.t0.value)


@dataclass
class Contended:
    name: str
    holds: int
    attempts: int
    duration: float

    @property
    def per_second(self) -> float:
        return self.holds / self.duration


def contended(
    urls: list[str],
    processes: int,
    duration: float,
    slice_length: float,
    retry_delay: float,
    transports: Sequence[str],
) -> dict[str, Contended]:
    """Every kind, ``duration`` seconds each, in alternating slices of ``slice_length``."""
    ctx = multiprocessing.get_context("spawn")
    start_at = StartSignal(ctx)
    ready = ctx.Queue()
    results = ctx.Queue()
    kinds = [*(impl("redlock", t, transports) for t in transports), "floor"]
    slices = len(kinds) * max(1, round(duration / slice_length))
    slice_length = len(kinds) * duration / slices
    key = f"bench:contended:{len(urls)}"
    procs = [
        ctx.Process(
            target=contender,
            args=(urls, key, start_at, ready, results, slices, slice_length, retry_delay, list(transports)),
            daemon=True,
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        # A short lead so every process is waiting on the clock, not still waking up.
        start_at.set(time.monotonic() + 0.2)
        total_holds = dict.fromkeys(kinds, 0)
        total_attempts = dict.fromkeys(kinds, 0)
        for _ in procs:
            _, holds, attempts = results.get(timeout=len(kinds) * duration + CONTENDED_GRACE)
            for kind in kinds:
                total_holds[kind] += holds[kind]
                total_attempts[kind] += attempts[kind]
        for proc in procs:
            proc.join(timeout=10)
        return {kind: Contended(kind, total_holds[kind], total_attempts[kind], duration) for kind in kinds}
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5)


# -- report ---------------------------------------------------------------------------------------
def row(cells: Sequence[object], widths: Sequence[int]) -> str:
    return "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def table(header: Sequence[str], rows: list[list[object]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = [row(header, widths), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += [row(r, widths) for r in rows]
    return "\n".join(lines)


def flush(servers: ServerSet) -> None:
    for server in servers:
        server.flushall()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--async" in argv:  # the asyncio lock has a benchmark of its own, with its own options
        from bench_async import main as async_main

        return async_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--masters", default="1,3,5", help="master counts to run, e.g. 1,3,5")
    parser.add_argument(
        "--iterations",
        type=int,
        default=3000,
        help="uncontended acquire+release iterations per implementation",
    )
    parser.add_argument("--warmup", type=int, default=300, help="uncontended warm-up iterations")
    parser.add_argument("--block", type=int, default=100, help="uncontended iterations per alternating block")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per contended run")
    parser.add_argument("--processes", type=int, default=8, help="contending processes")
    parser.add_argument(
        "--slice", type=float, default=1.0, help="contended: seconds per alternating redlock/floor slice"
    )
    parser.add_argument(
        "--retry-delay",
        type=float,
        default=0.0,
        help="contended retry: random delay in [0, this) s (0 = retry at once)",
    )
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"Redlock transports to run side by side, of {', '.join(TRANSPORTS)}",
    )
    parser.add_argument("--skip-contended", action="store_true")
    parser.add_argument("--skip-uncontended", action="store_true")
    parser.add_argument("--skip-degraded", action="store_true")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.masters.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--masters: expected comma-separated integers, got {args.masters!r}")
    if not counts or min(counts) < 1:
        parser.error(f"--masters: every count must be >= 1, got {args.masters!r}")
    for name in ("iterations", "warmup", "block", "processes"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.duration <= 0 or args.slice <= 0 or args.retry_delay < 0:
        parser.error("--duration and --slice must be > 0, --retry-delay >= 0")
    transports = list(dict.fromkeys(t.strip() for t in args.transports.split(",") if t.strip()))
    if not transports or not set(transports) <= set(TRANSPORTS):
        parser.error(f"--transports: expected some of {', '.join(TRANSPORTS)}, got {args.transports!r}")

    print(
        f"python {sys.version.split()[0]}, redis-py {redis.__version__}, "
        f"parser {'hiredis' if redis.utils.HIREDIS_AVAILABLE else 'python'}, "
        f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at start"
    )
    unc_rows: list[list[object]] = []
    con_rows: list[list[object]] = []
    deg_rows: list[list[object]] = []
    with ServerSet(max(counts)) as servers:
        print(f"masters: {servers[0].binary}")
        for n in counts:
            urls = servers.urls[:n]
            if not args.skip_uncontended:
                flush(servers)
                samples = uncontended(urls, args.iterations, args.warmup, args.block, transports)
                floor = samples[-1]
                for s in samples:
                    unc_rows.append(
                        [
                            n,
                            s.name,
                            f"{s.p(0.5):.0f}",
                            f"{s.p(0.99):.0f}",
                            f"{s.ops:.0f}",
                            f"{s.p(0.5) / floor.p(0.5):.2f}x",
                            f"{s.ops / floor.ops:.2f}x",
                        ]
                    )
                plain = ", ".join(f"{s.name} p50 {s.p(0.5):.0f} us" for s in samples[:-1:2])
                print(f"  N={n} uncontended: {plain}, floor p50 {floor.p(0.5):.0f} us", flush=True)
            if not args.skip_contended:
                flush(servers)
                by_kind = contended(
                    urls, args.processes, args.duration, args.slice, args.retry_delay, transports
                )
                runs = list(by_kind.values())
                floor_run = by_kind["floor"]
                for run in runs:
                    ratio = run.per_second / floor_run.per_second if floor_run.holds else float("nan")
                    con_rows.append(
                        [
                            n,
                            run.name,
                            f"{run.per_second:.0f}",
                            f"{run.attempts / run.duration:.0f}",
                            f"{run.holds / max(run.attempts, 1):.2f}",
                            f"{ratio:.2f}x",
                        ]
                    )
                held = ", ".join(f"{run.name} {run.per_second:.0f}/s" for run in runs)
                print(f"  N={n} contended: {held}", flush=True)
        n = max(counts)
        if not args.skip_degraded and n >= 3:  # with one master stopped, a quorum must remain
            flush(servers)
            for up, down in degraded(servers.urls[:n], args.iterations, args.warmup, args.block, transports):
                for s in (up, down):
                    deg_rows.append(
                        [
                            n,
                            s.name,
                            f"{s.p(0.5):.0f}",
                            f"{s.p(0.99):.0f}",
                            f"{s.ops:.0f}",
                            f"{s.p(0.5) / up.p(0.5):.2f}x",
                        ]
                    )
                print(
                    f"  N={n} degraded: {down.name} p50 {down.p(0.5):.0f} us, {up.name} {up.p(0.5):.0f} us",
                    flush=True,
                )

    if unc_rows:
        print(
            f"\nUncontended acquire+release, one thread, {args.iterations} iterations each after "
            f"{args.warmup} warm-up, in alternating blocks of {args.block}"
        )
        print(table(["N", "impl", "p50 us", "p99 us", "ops/s", "p50 / floor", "ops/s / floor"], unc_rows))
    if deg_rows:
        print(
            f"\nDegraded: the uncontended Redlock loop with all masters up and with one stopped, "
            f"{args.iterations} iterations each, in alternating blocks of {args.block}"
        )
        print(table(["N", "masters", "p50 us", "p99 us", "ops/s", "p50 / all up"], deg_rows))
    if con_rows:
        retry = "at once" if args.retry_delay == 0 else f"after U[0, {args.retry_delay}) s"
        print(
            f"\nContended: {args.processes} processes, one resource, {args.duration:g} s each, "
            f"in alternating slices of about {args.slice:g} s, retry {retry}"
        )
        print(table(["N", "impl", "holds/s", "tries/s", "holds/try", "holds / floor"], con_rows))
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
