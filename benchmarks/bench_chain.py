"""Same-key work through Celery: duplicates draining one lock, and a chain of links on one key.

Run:  python benchmarks/bench_chain.py [--drain] [--chain] [options]    (neither flag: both)

      python benchmarks/bench_chain.py --drain [--duplicates 20] [--body 0.05] [--rounds 3]
      python benchmarks/bench_chain.py --chain [--links 10] [--chains 20] [--pools prefork,solo]

A real broker, ``--masters`` lock masters (5) and real ``celery worker`` processes, all started
(and stopped) here; the tasks live in a module written to a temporary directory.

``--drain``: two prefork workers with 2 children each. ``--duplicates`` tasks of a ``--body``
second body all lock one name, so they must run one after another: the serial bound is
``duplicates x body`` (1.0 s by default). Measured from the first send to the last result, for
``lock_contended="wait"`` (a duplicate waits in its worker, woken by the release) and for
``"retry"`` (it is re-published after a jittered backoff, the default 1 s base). The goal:
wait mode under 1.5x the bound.

``--chain``: a chain of ``--links`` no-op links, each ``.si(k, i)``, all on one key ``k`` (a fresh
one per chain), so each link locks the name its predecessor held a moment before. A run's lock is
released as its body ends, before Celery publishes the next link and stores the result, so no
link should find it held. The same chain of plain tasks (no lock) is the baseline; the locked links are
``RedlockTask`` with ``lock_key="step:<k>"`` in modes ``retry``, ``skip`` and ``fail``, and
``wait`` for reference. ``floor`` is the least any Redlock link must do, as in ``bench_celery.py``:
``SET key token NX PX ttl`` to every master over a plain socket before the body, the
compare-and-delete with its replies read as it ends (``floor.py``); a yardstick for what two rounds
to the masters cost a link on this machine, not a lock. Each round runs one chain per mode, in an
order that rotates from round to round, so every mode sees the same machine load; ``--chains``
rounds on one prefork worker with 2 children, then on one solo worker. A chain's wall time runs
from its ``apply_async`` to its last link's result. Links *skipped* returned the skip marker
(``is_skipped``); links *failed* ended in any other way than success (a failed link fails the rest
of its chain with it); *lock retries* are the ``lock_contended`` signals with policy ``retry``,
counted by the worker in the broker. The goal: 0 links skipped or failed in every mode, and
a median wall time at most 1.2x the floor's. The goal was once 1.2x plain's; but a release that
takes effect before the next link can start makes every link pay two rounds to the masters in
series, and the floor alone, which is those two rounds and nothing else, takes about 1.2x plain
(``/ plain`` shows both). Exit status 1 if any link was skipped or failed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from celery import Celery, chain
from celery.exceptions import TimeoutError as ResultTimeout
from celery.result import AsyncResult

from celery_redlock import is_skipped
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

APP_SOURCE = textwrap.dedent("""
    import os
    import time

    import redis
    from celery import Celery
    from floortask import FloorTask

    from celery_redlock import RedlockTask
    from celery_redlock.signals import lock_contended

    app = Celery("chainapp", broker=os.environ["BENCH_BROKER"], backend=os.environ["BENCH_BROKER"])
    app.conf.update(redlock_masters=os.environ["BENCH_MASTERS"], worker_prefetch_multiplier=1)
    BODY = float(os.environ["BENCH_BODY"])
    counts = redis.Redis.from_url(os.environ["BENCH_BROKER"])  # reconnects after a fork by itself

    @lock_contended.connect
    def count_contended(sender, policy, **_):
        counts.hincrby("bench:contended", "%s:%s" % (sender.name, policy), 1)

    # --drain: duplicates of a BODY-second body on one name.
    @app.task(base=RedlockTask, lock_key="chain:<run>", lock_contended="wait", name="drain.wait")
    def drain_wait(run, i):
        time.sleep(BODY)
        return i

    @app.task(base=RedlockTask, lock_key="chain:<run>", lock_contended="retry", name="drain.retry")
    def drain_retry(run, i):
        time.sleep(BODY)
        return i

    # --chain: no-op links, one key per chain.
    @app.task(name="chain.plain")
    def plain(k, i):
        return i

    @app.task(base=FloorTask, name="chain.floor")
    def floor_step(k, i):
        return i

    @app.task(base=RedlockTask, lock_key="step:<k>", lock_contended="retry", name="chain.retry")
    def step_retry(k, i):
        return i

    @app.task(base=RedlockTask, lock_key="step:<k>", lock_contended="skip", name="chain.skip")
    def step_skip(k, i):
        return i

    @app.task(base=RedlockTask, lock_key="step:<k>", lock_contended="fail", name="chain.fail")
    def step_fail(k, i):
        return i

    @app.task(base=RedlockTask, lock_key="step:<k>", lock_contended="wait", name="chain.wait")
    def step_wait(k, i):
        return i
""")

CONTENDED = "bench:contended"  # hash the app counts lock_contended signals in: "task:policy" -> n
MODES = ("plain", "floor", "retry", "skip", "fail", "wait")
HERE = Path(__file__).resolve().parent  # floor.py is imported from here by the worker


def drain(client: Celery, task: str, run: str, count: int) -> float:
    started = time.perf_counter()
    results = [client.send_task(task, (run, i), queue="chain") for i in range(count)]
    for result in results:
        result.get(timeout=300)
    return time.perf_counter() - started


def measure_drain(args: argparse.Namespace, env: dict[str, str], workdir: Path) -> None:
    bound = args.duplicates * args.body
    times: dict[str, list[float]] = {"drain.wait": [], "drain.retry": []}
    workers = [
        CeleryWorker("chainapp", pool="prefork", concurrency=2, queues=["chain"], env=env,
                     pythonpath=[str(workdir), str(HERE)])
        for _ in range(2)
    ]  # fmt: skip
    client = Celery("chain-client", broker=env["BENCH_BROKER"], backend=env["BENCH_BROKER"])
    try:
        for worker in workers:
            worker.start()
        drain(client, "drain.wait", "warm-up", 4)  # connections and subscribers made
        for n in range(args.rounds):
            for task in times:
                times[task].append(drain(client, task, f"{task}-{n}", args.duplicates))
    finally:
        client.close()
        for worker in workers:
            worker.stop()
    print(
        f"{args.duplicates} duplicates of a {args.body * 1000:.0f} ms body, prefork 2 workers x 2, "
        f"{args.masters} masters, median of {args.rounds}; serial bound {bound:.2f} s"
    )
    print("| lock_contended | drain s | / bound |")
    print("|---|--:|--:|")
    for task, samples in times.items():
        median = statistics.median(samples)
        print(f"| {task.split('.')[1]} | {median:.2f} | {median / bound:.2f}x |")


@dataclass
class Tally:
    """One mode's chains on one pool."""

    seconds: list[float] = field(default_factory=list)
    skipped: int = 0
    failed: int = 0
    retries: int = 0

    def p90(self) -> float:
        if len(self.seconds) < 2:
            return max(self.seconds)
        return statistics.quantiles(self.seconds, n=10)[-1]


def run_chain(client: Celery, mode: str, key: str, links: int, queue: str, timeout: float) -> Tally:
    """One chain of ``links`` links of ``chain.<mode>`` on ``key``: its wall time and its links."""
    steps = [
        client.signature(f"chain.{mode}", args=(key, i), immutable=True, queue=queue) for i in range(links)
    ]
    started = time.perf_counter()
    last = chain(*steps).apply_async()
    with contextlib.suppress(ResultTimeout):  # a link that never ends counts as failed below
        last.get(timeout=timeout, propagate=False)
    tally = Tally(seconds=[time.perf_counter() - started])
    ended = last.ready()
    result: AsyncResult | None = last
    while result is not None:
        if ended:
            # Celery publishes a link's successor before it stores the link's own result: under
            # prefork the last link can be done while the one before it is not yet stored.
            result.get(timeout=timeout, propagate=False)
        if not result.successful():
            tally.failed += 1
        elif is_skipped(result.result):
            tally.skipped += 1
        result = result.parent
    return tally


def chain_pool(args: argparse.Namespace, env: dict[str, str], workdir: Path, pool: str) -> dict[str, Tally]:
    """``--chains`` rounds of one chain per mode on one worker of ``pool``."""
    queue = f"steps-{pool}"
    tallies = {mode: Tally() for mode in MODES}
    counts = redis.Redis.from_url(env["BENCH_BROKER"])
    worker = CeleryWorker(
        "chainapp",
        pool=pool,
        concurrency=args.concurrency if pool == "prefork" else None,
        queues=[queue],
        env=env,
        pythonpath=[str(workdir), str(HERE)],
    )
    client = Celery("chain-client", broker=env["BENCH_BROKER"], backend=env["BENCH_BROKER"])
    try:
        worker.start()
        for n in range(3):  # every pool child connected to the masters, the client subscribed
            for mode in MODES:
                run_chain(client, mode, f"warm-{pool}-{mode}-{n}", args.links, queue, args.timeout)
        counts.delete(CONTENDED)
        for n in range(args.chains):
            turn = n % len(MODES)
            for mode in MODES[turn:] + MODES[:turn]:
                one = run_chain(client, mode, f"{pool}-{mode}-{n}", args.links, queue, args.timeout)
                tally = tallies[mode]
                tally.seconds += one.seconds
                tally.skipped += one.skipped
                tally.failed += one.failed
        for name, number in counts.hgetall(CONTENDED).items():
            task, policy = name.decode().split(":")
            if policy == "retry":
                tallies[task.split(".")[1]].retries += int(number)
    finally:
        client.close()
        counts.close()
        worker.stop()
    return tallies


def print_chain(args: argparse.Namespace, pool: str, tallies: dict[str, Tally]) -> None:
    shape = f"prefork worker ({args.concurrency} children)" if pool == "prefork" else f"{pool} worker"
    print(
        f"\n{args.links}-link same-key chain of no-op tasks, one {shape}, {args.masters} masters; "
        f"{args.chains} chains per mode"
    )
    print("| mode | median ms | p90 ms | / plain | / floor | links skipped | links failed | lock retries |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    plain = statistics.median(tallies["plain"].seconds)
    floor = statistics.median(tallies["floor"].seconds)
    for mode, tally in tallies.items():
        median = statistics.median(tally.seconds)
        print(
            f"| {mode} | {median * 1000:.1f} | {tally.p90() * 1000:.1f} | {median / plain:.2f}x "
            f"| {median / floor:.2f}x | {tally.skipped} | {tally.failed} | {tally.retries} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drain", action="store_true", help="only the duplicates-drain measurement")
    parser.add_argument("--chain", action="store_true", help="only the same-key chain measurement")
    parser.add_argument("--masters", type=int, default=5)
    parser.add_argument("--duplicates", type=int, default=20)
    parser.add_argument("--body", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3, help="drain rounds")
    parser.add_argument("--links", type=int, default=10, help="links per chain")
    parser.add_argument("--chains", type=int, default=20, help="chains per mode and pool")
    parser.add_argument("--pools", default="prefork,solo")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for one chain")
    args = parser.parse_args()
    both = not (args.drain or args.chain)
    workdir = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    (workdir / "chainapp.py").write_text(APP_SOURCE)
    lost = 0
    with RedisServer() as broker, ServerSet(args.masters) as masters:
        env = {
            "BENCH_BROKER": broker.url,
            "BENCH_MASTERS": ",".join(masters.urls),
            "BENCH_BODY": str(args.body),
        }
        if args.drain or both:
            measure_drain(args, env, workdir)
        if args.chain or both:
            for pool in args.pools.split(","):
                tallies = chain_pool(args, env, workdir, pool)
                print_chain(args, pool, tallies)
                lost += sum(tally.skipped + tally.failed for tally in tallies.values())
    if lost:
        print(f"\n{lost} links skipped or failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
