"""AsyncRedlock's cost over N loopback masters, against the asyncio floor and the async peers.

Run:  python benchmarks/bench_lock.py --async [--masters 1,5] [--iterations 3000]
                                               [--duration 5] [--processes 4] [--tasks 4]
      (or python benchmarks/bench_async.py with the same options)

Uncontended: one event loop, one task, one resource, ``acquire(blocking=False)`` then
``release()``, timed per iteration. The *floor* (``floor_async.py``) is ``floor.py``'s commands
over asyncio streams: ``SET NX PX`` written to every master and every reply awaited, then the
release script by digest, replies awaited; no timeouts, votes or parser. Peers, where they can
run: ``redis.asyncio``'s ``Lock`` (one server: N = 1 only), pottery's ``AIORedlock`` and
redlock-ng's ``AsyncRedlock``. Every implementation runs in alternating blocks in the same loop,
so all see the same machine load.

Contended: ``--processes`` processes, each an event loop of ``--tasks`` tasks looping on one
resource (a hold is one successful acquisition and its release; a failed try is retried at once,
or with ``--retry-delay d`` after a random delay in ``[0, d)``, the same for every kind). Every
kind runs in every process, in alternating time slices of ``--slice`` seconds by the shared
monotonic clock, each on its own key. An AsyncRedlock (and a redis.asyncio client, and a
redlock-ng ``AsyncRedlock``, whose acquire returns the held lock) is shared by the tasks of its
process, as an application shares one; the floor and pottery get one client per task (a raw
stream serves one caller at a time; a pottery lock keeps its token).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import multiprocessing
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis
import redis.asyncio
from bench_lock import CONTENDED_GRACE, TTL, TTL_MS, Contended, Samples, StartSignal, flush, slice_kind, table
from floor_async import AsyncRawMasters

from celery_redlock import AsyncRedlock
from celery_redlock.testing import ServerSet

Step = Callable[[], Awaitable[bool]]
HAVE_POTTERY = importlib.util.find_spec("pottery") is not None


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# redlock-ng's module is ``redlock``, as redlock-py's is: asked by its distribution's name.
HAVE_REDLOCK_NG = _installed("redlock-ng")


# -- one try of each kind: True when it held (and released) the lock -----------------------------
def redlock_try(redlock: AsyncRedlock, key: str) -> Step:
    lock = redlock.lock(key, ttl=TTL)

    async def attempt() -> bool:
        if await lock.acquire(blocking=False):
            await lock.release()
            return True
        return False

    return attempt


def floor_try(floor: AsyncRawMasters, key: str) -> Step:
    """A hold is a quorum of OKs, released with its replies awaited; a failed attempt's OKs are
    retracted without waiting (as the library does)."""

    async def attempt() -> bool:
        token = secrets.token_hex(20)
        won = await floor.set_nx(key, token, TTL_MS)
        if len(won) >= floor.quorum:
            await floor.release(key, token, won)
            return True
        if won:
            floor.retract(key, token, won)
        return False

    return attempt


def redis_py_try(client: redis.asyncio.Redis, key: str) -> Step:
    lock = client.lock(key, timeout=TTL, blocking=False, thread_local=False)

    async def attempt() -> bool:
        if await lock.acquire(blocking=False):
            await lock.release()
            return True
        return False

    return attempt


def pottery_try(clients: Sequence[redis.asyncio.Redis], key: str) -> Step:
    from pottery import AIORedlock

    lock = AIORedlock(key=key, masters=clients, auto_release_time=TTL)

    async def attempt() -> bool:
        if await lock.acquire(blocking=False):
            await lock.release()
            return True
        return False

    return attempt


def redlock_ng_try(redlock: Any, key: str) -> Step:
    """redlock-ng: ``acquire`` returns the held lock (or None); TTLs in milliseconds."""

    async def attempt() -> bool:
        held = await redlock.acquire(key, TTL_MS)
        if held is None:
            return False
        await redlock.release(held)
        return True

    return attempt


def redlock_ng(urls: Sequence[str]) -> Any:
    """redlock-ng's AsyncRedlock: one attempt per acquire (``retry_count=0``), its clients' own
    timeouts (0.1 s), one redis.asyncio client per master."""
    from redlock import AsyncRedlock as NgAsyncRedlock

    return NgAsyncRedlock(list(urls), retry_count=0)


class Clients:
    """Every kind's clients for one process (or one uncontended run), and their closing."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.redlock = AsyncRedlock(urls, ttl=TTL, retry_count=0)
        self.redis_py = redis.asyncio.Redis.from_url(urls[0]) if len(urls) == 1 else None
        self.pottery = [redis.asyncio.Redis.from_url(u) for u in urls] if HAVE_POTTERY else []
        self.redlock_ng = redlock_ng(urls) if HAVE_REDLOCK_NG else None
        self.floors: list[AsyncRawMasters] = []

    async def floor(self) -> AsyncRawMasters:
        floor = await AsyncRawMasters.open(self.urls)
        self.floors.append(floor)
        return floor

    async def steps(self, key: str) -> dict[str, Step]:
        """One step of each kind that can run here, each on a key of its own."""
        steps = {
            "async redlock": redlock_try(self.redlock, f"{key}:redlock"),
            "asyncio floor": floor_try(await self.floor(), f"{key}:floor"),
        }
        if self.redis_py is not None:
            steps["redis.asyncio Lock"] = redis_py_try(self.redis_py, f"{key}:redis-py")
        if self.pottery:
            steps["pottery AIORedlock"] = pottery_try(self.pottery, f"{key}:pottery")
        if self.redlock_ng is not None:
            steps["redlock-ng AsyncRedlock"] = redlock_ng_try(self.redlock_ng, f"{key}:redlock-ng")
        return steps

    async def aclose(self) -> None:
        await self.redlock.aclose()
        for floor in self.floors:
            await floor.aclose()
        ng = self.redlock_ng.client.instances if self.redlock_ng is not None else []
        for client in [*([self.redis_py] if self.redis_py else []), *self.pottery, *ng]:
            await client.aclose()


# -- uncontended ----------------------------------------------------------------------------------
async def run_block(step: Step, count: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        t0 = clock()
        if not await step():
            raise RuntimeError("an uncontended acquire was refused")
        into.append(clock() - t0)


async def uncontended(urls: Sequence[str], iterations: int, warmup: int, block: int) -> list[Samples]:
    """Every kind, ``iterations`` times after ``warmup``, in alternating blocks (floor last)."""
    clients = Clients(urls)
    try:
        steps = await clients.steps(f"bench:async:uncontended:{len(urls)}")
        floor = steps.pop("asyncio floor")
        steps["asyncio floor"] = floor
        samples = {name: Samples(name, []) for name in steps}
        for step in steps.values():
            await run_block(step, warmup, [])
        done = 0
        while done < iterations:
            count = min(block, iterations - done)
            order = list(steps) if (done // block) % 2 == 0 else list(reversed(steps))
            for name in order:
                await run_block(steps[name], count, samples[name].ns)
            done += count
        return list(samples.values())
    finally:
        await clients.aclose()


# -- contended ------------------------------------------------------------------------------------
async def contend(
    urls: list[str],
    key: str,
    start_at: Any,
    ready: Any,
    tasks: int,
    slices: int,
    slice_length: float,
    retry_delay: float,
) -> tuple[dict[str, int], dict[str, int]]:
    clients = Clients(urls)
    try:
        per_task = [await clients.steps(key) for _ in range(tasks)]
        kinds = list(per_task[0])
        holds = dict.fromkeys(kinds, 0)
        attempts = dict.fromkeys(kinds, 0)
        for steps in per_task:  # connect before the clock starts
            for step in steps.values():
                await step()
        ready.put(os.getpid())
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, start_at.wait, 60):
            return holds, attempts
        t0 = start_at.value
        end = t0 + slices * slice_length

        async def worker(steps: dict[str, Step]) -> None:
            while True:
                now = time.monotonic()
                if now >= end:
                    return
                if now < t0:
                    await asyncio.sleep(t0 - now)
                    continue
                kind = slice_kind(int((now - t0) / slice_length), kinds)
                attempts[kind] += 1
                if await steps[kind]():
                    holds[kind] += 1
                elif retry_delay > 0:  # the same random delay for every kind (as bench_lock's)
                    await asyncio.sleep(random.uniform(0, retry_delay))

        await asyncio.gather(*(worker(steps) for steps in per_task))
        return holds, attempts
    finally:
        await clients.aclose()


def contender(
    urls: list[str],
    key: str,
    start_at: Any,
    ready: Any,
    results: Any,
    tasks: int,
    slices: int,
    length: float,
    retry_delay: float,
) -> None:
    holds, attempts = asyncio.run(contend(urls, key, start_at, ready, tasks, slices, length, retry_delay))
    results.put((os.getpid(), holds, attempts))


def contended(
    urls: list[str],
    processes: int,
    tasks: int,
    duration: float,
    slice_length: float,
    retry_delay: float = 0.0,
) -> dict[str, Contended]:
    ctx = multiprocessing.get_context("spawn")
    start_at = StartSignal(ctx)
    ready = ctx.Queue()
    results = ctx.Queue()
    kinds = 2 + (len(urls) == 1) + HAVE_POTTERY + HAVE_REDLOCK_NG
    slices = kinds * max(1, round(duration / slice_length))
    slice_length = kinds * duration / slices
    key = f"bench:async:contended:{len(urls)}"
    procs = [
        ctx.Process(
            target=contender,
            args=(urls, key, start_at, ready, results, tasks, slices, slice_length, retry_delay),
            daemon=True,
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        start_at.set(time.monotonic() + 0.2)
        total_holds: dict[str, int] = {}
        total_attempts: dict[str, int] = {}
        for _ in procs:
            _, holds, attempts = results.get(timeout=kinds * duration + CONTENDED_GRACE)
            for kind in holds:
                total_holds[kind] = total_holds.get(kind, 0) + holds[kind]
                total_attempts[kind] = total_attempts.get(kind, 0) + attempts[kind]
        for proc in procs:
            proc.join(timeout=10)
        return {k: Contended(k, total_holds[k], total_attempts[k], duration) for k in total_holds}
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5)


# -- report ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--async", dest="is_async", action="store_true", help="(implied)")
    parser.add_argument("--masters", default="1,5", help="master counts to run, e.g. 1,5")
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--duration", type=float, default=5.0, help="contended seconds per kind")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=4, help="contending tasks per process")
    parser.add_argument("--slice", type=float, default=0.5)
    parser.add_argument(
        "--retry-delay",
        type=float,
        default=0.0,
        help="contended: a failed try is retried at once (0), or after a random delay in [0, d) s, "
        "the same for every kind",
    )
    parser.add_argument("--skip-contended", action="store_true")
    parser.add_argument("--skip-uncontended", action="store_true")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.masters.split(",") if n.strip()]
    if not counts or min(counts) < 1 or min(args.iterations, args.block, args.processes, args.tasks) < 1:
        parser.error("--masters, --iterations, --block, --processes and --tasks must be positive")
    if args.retry_delay < 0:
        parser.error("--retry-delay must be >= 0")
    print(
        f"python {sys.version.split()[0]}, redis-py {redis.__version__}, pottery "
        f"{'yes' if HAVE_POTTERY else 'not installed'}, redlock-ng "
        f"{importlib.metadata.version('redlock-ng') if HAVE_REDLOCK_NG else 'not installed'}, "
        f"{os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    unc_rows: list[list[object]] = []
    con_rows: list[list[object]] = []
    with ServerSet(max(counts)) as servers:
        for n in counts:
            urls = servers.urls[:n]
            if not args.skip_uncontended:
                flush(servers)
                samples = asyncio.run(uncontended(urls, args.iterations, args.warmup, args.block))
                floor = samples[-1]
                for s in samples:
                    ratio = s.p(0.5) / floor.p(0.5)
                    unc_rows.append(
                        [n, s.name, f"{s.p(0.5):.0f}", f"{s.p(0.99):.0f}", f"{s.ops:.0f}", f"{ratio:.2f}x"]
                    )
                print(
                    f"  N={n} uncontended: " + ", ".join(f"{s.name} {s.p(0.5):.0f} us" for s in samples),
                    flush=True,
                )
            if not args.skip_contended:
                flush(servers)
                runs = contended(
                    urls, args.processes, args.tasks, args.duration, args.slice, args.retry_delay
                )
                floor_run = runs["asyncio floor"]
                for run in runs.values():
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
                print(
                    f"  N={n} contended: "
                    + ", ".join(f"{r.name} {r.per_second:.0f}/s" for r in runs.values())
                )
    if unc_rows:
        print(
            f"\nUncontended acquire+release, one task, {args.iterations} iterations each, "
            f"blocks of {args.block}"
        )
        print(table(["N", "impl", "p50 us", "p99 us", "ops/s", "p50 / floor"], unc_rows))
    if con_rows:
        print(
            f"\nContended: {args.processes} processes x {args.tasks} tasks, one resource, "
            f"{args.duration:g} s each, slices of about {args.slice:g} s, retry "
            + ("at once" if args.retry_delay == 0 else f"after U[0, {args.retry_delay:g}) s")
        )
        print(table(["N", "impl", "holds/s", "tries/s", "holds/try", "holds / floor"], con_rows))
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
