"""Throughput of no-op tasks through a real worker: plain, locked by RedlockTask, and the floor.

    python benchmarks/bench_celery.py [--tasks 1000] [--rounds 12] [--pools solo,prefork]
                                      [--masters 1,3,5]

Starts its own broker/backend server and lock masters on free loopback ports, and one real
``celery worker`` per (master count, pool). Each worker runs ``--rounds`` rounds; a round is three
batches of ``--tasks`` no-op tasks, in an order that rotates from round to round:

- ``plain``: no lock at all;
- ``locked``: ``RedlockTask`` with a distinct key per task (never reused);
- ``floor``: the least any Redlock task has to do, written inline: ``SET key token NX PX ttl`` to
  every master over a plain socket in ``before_start``, count the OKs, and, as the body ends and
  before Celery stores the result, the release (compare-and-delete) with its replies read (a
  lock whose release lands after the run's completion is visible lets the next step of the same
  resource find it held). No timeouts, no votes, no heartbeat, no error handling: a same-run
  yardstick, not a lock anyone should use.

With ``--publish N`` (default 2000; 0 skips it) it also measures the *publish rate*: calls/s of
``apply_async`` from one thread of this process into a queue nobody consumes, in alternating
batches of N: a plain Celery task, a ``RedlockTask`` without ``lock_enqueue`` (its publish is
Celery's own), one with ``lock_enqueue="return_existing"`` and a fresh key per call (one Redlock
round, the marker, before each publish), and the same with one key for every call (the duplicate
path: a refused round and a holder read, nothing published). ``--publish-only`` skips the workers.

Each batch is timed from the first send until every result is in. Prints, per worker, the median
over rounds of locked/plain, floor/plain and locked/floor throughput (the batches of one round see
nearly the same machine, which a shared machine's drifting speed does not allow across rounds),
the rates over all rounds, and the CPU each kind added per task to the worker and to the masters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from celery import Celery

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

HERE = Path(__file__).resolve().parent  # floor.py is imported from here by the worker

APP_SOURCE = textwrap.dedent("""
    import os

    from celery import Celery
    from floortask import FloorTask

    from celery_redlock import RedlockTask

    app = Celery("benchapp", broker=os.environ["BENCH_BROKER"], backend=os.environ["BENCH_BROKER"])
    app.conf.update(redlock_masters=os.environ["BENCH_MASTERS"], worker_prefetch_multiplier=16)

    @app.task(name="bench.plain")
    def plain(i):
        return i

    @app.task(base=RedlockTask, lock_key="bench:<i>", name="bench.locked")
    def locked(i):
        return i

    @app.task(base=FloorTask, name="bench.floor")
    def floor(i):
        return i
""")

KINDS = ("bench.plain", "bench.floor", "bench.locked")


def run_batch(app: Celery, name: str, count: int, queue: str, first: int = 0) -> float:
    started = time.perf_counter()
    results = [app.send_task(name, (first + i,), queue=queue) for i in range(count)]
    for result in results:
        result.get(timeout=300)
    return time.perf_counter() - started


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes have used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def wait_pinged(client: Celery, worker: CeleryWorker, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.control.ping(destination=[worker.hostname], timeout=0.5):
        if not worker.running or time.monotonic() > deadline:
            worker.kill()
            raise RuntimeError(f"{worker!r} did not answer a ping: {worker.log_tail()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000, help="tasks per batch")
    parser.add_argument(
        "--rounds",
        type=int,
        default=12,
        help="rounds of one batch of each kind (a multiple of 3 puts each kind in each place equally)",
    )
    parser.add_argument("--pools", default="solo,prefork")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children")
    parser.add_argument(
        "--masters", default="5", help="comma-separated lock master counts to measure, e.g. 1,3,5"
    )
    parser.add_argument("--publish", type=int, default=2000, help="apply_async calls per publish batch")
    parser.add_argument("--publish-only", action="store_true", help="measure only the publish rate")
    args = parser.parse_args()
    counts = [int(n) for n in args.masters.split(",")]
    if args.publish:
        publish_rates(args, counts)
    if args.publish_only:
        return

    workdir = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    (workdir / "benchapp.py").write_text(APP_SOURCE)
    rows = []
    with RedisServer() as broker, ServerSet(max(counts)) as masters:
        client = Celery("bench-client", broker=broker.url, backend=broker.url)
        for count in counts:
            env = {
                "BENCH_BROKER": broker.url,
                "BENCH_MASTERS": ",".join(masters.urls[:count]),
            }
            pids = [pid for pid in (m.pid for m in list(masters)[:count]) if pid is not None]
            for pool in args.pools.split(","):
                rows.append((count, pool, measure(client, pool, args, env, workdir, pids)))
        client.close()
    print(
        f"{args.tasks} no-op tasks per batch, {args.rounds} rounds of a plain, a floor and a locked "
        f"batch (order rotating), python {sys.version.split()[0]}; ratios: median over rounds of "
        "throughput / plain throughput"
    )
    header = (
        "masters",
        "pool",
        "plain/s",
        "floor/s",
        "locked/s",
        "floor",
        "locked",
        "locked range",
        "locked/floor",
        "worker CPU floor",
        "worker CPU locked",
        "masters CPU floor",
        "masters CPU locked",
    )
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("--:" if i != 1 else "---" for i in range(len(header))) + "|")
    for count, pool, r in rows:
        cells = [
            str(count),
            pool,
            f"{r['plain']:.0f}",
            f"{r['floor']:.0f}",
            f"{r['locked']:.0f}",
            f"{r['floor_ratio']:.2f}",
            f"{r['locked_ratio']:.2f}",
            f"{r['locked_low']:.2f}-{r['locked_high']:.2f}",
            f"{r['locked_floor']:.2f}",
            f"{r['floor_worker']:.2f}",
            f"{r['locked_worker']:.2f}",
            f"{r['floor_masters']:.2f}",
            f"{r['locked_masters']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        "floor, locked: median over rounds of that batch's throughput / the plain batch's; "
        "locked range: the lowest and highest round; locked/floor: median over rounds of the "
        "locked batch's throughput / the floor batch's of the same round"
    )
    print(
        "CPU columns: ms per task that kind added over plain, to the worker (all its processes) "
        "and to the masters"
    )


PUBLISH_KINDS = ("plain", "locked", "enqueue", "duplicate")


def publish_rates(args: argparse.Namespace, counts: list[int]) -> None:
    """apply_async calls/s, plain Celery against lock_enqueue, same run, alternating batches."""
    from celery_redlock import RedlockTask

    rows = []
    with RedisServer() as broker, ServerSet(max(counts)) as masters:
        for count in counts:
            for master in masters:  # no marker of a run over fewer masters splits this one's vote
                master.flushall()
            app = Celery(f"bench-publish-{count}", broker=broker.url, set_as_current=False)
            app.conf.update(redlock_masters=masters.urls[:count], broker_pool_limit=1)

            @app.task(name="bench.pub_plain")
            def pub_plain(i: int) -> int:
                return i

            @app.task(base=RedlockTask, name="bench.pub_locked", lock_key="pub:<i>")
            def pub_locked(i: int) -> int:
                return i

            @app.task(
                base=RedlockTask, name="bench.pub_enqueue", lock_key="pub:<i>", lock_enqueue="return_existing"
            )
            def pub_enqueue(i: int) -> int:
                return i

            tasks = {
                "plain": pub_plain,
                "locked": pub_locked,
                "enqueue": pub_enqueue,
                "duplicate": pub_enqueue,
            }
            queue = f"bench-publish-{os.getpid()}-{count}"
            store = broker.client()
            took: dict[str, list[float]] = {kind: [] for kind in PUBLISH_KINDS}
            serial = iter(range(10**9))
            for round_ in range(-1, args.rounds):  # round -1 warms up connections and code paths
                shift = round_ % len(PUBLISH_KINDS)
                for kind in PUBLISH_KINDS[shift:] + PUBLISH_KINDS[:shift]:
                    task = tasks[kind]
                    n = 50 if round_ < 0 else args.publish
                    keys = [-1] * n if kind == "duplicate" else [next(serial) for _ in range(n)]
                    started = time.perf_counter()
                    for key in keys:
                        task.apply_async((key,), queue=queue)
                    elapsed = time.perf_counter() - started
                    if round_ >= 0:
                        took[kind].append(elapsed)
                    store.delete(queue)
            app.close()
            rates = {kind: args.publish / statistics.median(times) for kind, times in took.items()}
            ratio = statistics.median(p / e for p, e in zip(took["plain"], took["enqueue"], strict=True))
            rows.append((count, rates, ratio))
    print(
        f"publish rate: apply_async calls/s from one thread, {args.publish} per batch, median of "
        f"{args.rounds} rounds (kinds alternating), into a queue nobody consumes"
    )
    print("| masters | plain/s | RedlockTask/s | lock_enqueue/s | lock_enqueue / plain | duplicate/s |")
    print("|--:|--:|--:|--:|--:|--:|")
    for count, rates, ratio in rows:
        print(
            f"| {count} | {rates['plain']:.0f} | {rates['locked']:.0f} | {rates['enqueue']:.0f} | "
            f"{ratio:.2f} | {rates['duplicate']:.0f} |"
        )
    print(
        "RedlockTask: no lock_enqueue (Celery's own publish); lock_enqueue: a fresh key per call; "
        "duplicate: lock_enqueue, one key held, nothing published"
    )


def measure(
    client: Celery,
    pool: str,
    args: argparse.Namespace,
    env: dict[str, str],
    workdir: Path,
    master_pids: list[int],
) -> dict[str, float]:
    """Rates, median ratios and added CPU per task for one pool, all kinds in the same worker."""
    queue = f"bench-{pool}-{os.getpid()}-{len(env['BENCH_MASTERS'])}"
    concurrency = args.concurrency if pool == "prefork" else 1
    worker = CeleryWorker(
        "benchapp",
        pool=pool,
        concurrency=concurrency,
        queues=[queue],
        env=env,
        pythonpath=[str(workdir), str(HERE)],
        loglevel="WARNING",
    )
    # WARNING keeps per-task log lines out of the timing; readiness then comes from a ping.
    worker.start(wait=False)
    took: dict[str, list[float]] = {name: [] for name in KINDS}
    cpu = {(name, who): 0.0 for name in KINDS for who in ("worker", "masters")}
    try:
        wait_pinged(client, worker)
        for name in KINDS:  # warm up connections, the pool and every code path
            run_batch(client, name, 50, queue, first=-50)
        assert worker.pid is not None
        worker_pids = [worker.pid, *worker.child_pids()]
        for round_ in range(args.rounds):
            first = round_ * args.tasks  # a fresh key per locked task: no lock is ever reused
            shift = round_ % len(KINDS)
            for name in KINDS[shift:] + KINDS[:shift]:
                before = cpu_seconds(worker_pids), cpu_seconds(master_pids)
                took[name].append(run_batch(client, name, args.tasks, queue, first))
                cpu[name, "worker"] += cpu_seconds(worker_pids) - before[0]
                cpu[name, "masters"] += cpu_seconds(master_pids) - before[1]
    finally:
        worker.stop()
    tasks = args.rounds * args.tasks
    plain = took["bench.plain"]

    def added(name: str, who: str) -> float:
        return (cpu[name, who] - cpu["bench.plain", who]) / tasks * 1000

    def ratios(name: str) -> list[float]:
        return [p / t for p, t in zip(plain, took[name], strict=True)]

    def ratio(name: str) -> float:
        return statistics.median(ratios(name))

    # The budget's ratio, paired within each round: its floor and locked batches ran seconds
    # apart, where the machine's speed drifts more from one round to another.
    paired = statistics.median(f / t for f, t in zip(took["bench.floor"], took["bench.locked"], strict=True))

    return {
        "plain": tasks / sum(plain),
        "floor": tasks / sum(took["bench.floor"]),
        "locked": tasks / sum(took["bench.locked"]),
        "floor_ratio": ratio("bench.floor"),
        "locked_ratio": ratio("bench.locked"),
        "locked_low": min(ratios("bench.locked")),
        "locked_high": max(ratios("bench.locked")),
        "locked_floor": paired,
        "floor_worker": added("bench.floor", "worker"),
        "locked_worker": added("bench.locked", "worker"),
        "floor_masters": added("bench.floor", "masters"),
        "locked_masters": added("bench.locked", "masters"),
    }


if __name__ == "__main__":
    main()
