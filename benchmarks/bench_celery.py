"""Throughput of no-op tasks through a real worker, plain vs RedlockTask (N masters), same run.

    python benchmarks/bench_celery.py [--tasks 2000] [--rounds 5] [--pools solo,prefork]
                                      [--masters 1,3,5]

Starts its own broker/backend server and lock masters on free loopback ports, and one real
``celery worker`` per (master count, pool). Each worker runs ``--rounds`` rounds; a round is a
batch of plain no-op tasks and a batch of locked no-op tasks (distinct keys, never reused),
``--tasks`` each, in the order plain, locked in even rounds and locked, plain in odd ones. Each
batch is timed from the first send until every result is in. Prints the median over rounds of
the locked/plain ratio (a round's two batches see nearly the same machine, which a shared
machine's drifting speed does not allow across rounds), the rates summed over all rounds, and
the lock's extra wall time per task.
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

APP_SOURCE = textwrap.dedent('''
    import os
    from celery import Celery
    from celery_redlock import RedlockTask

    app = Celery("benchapp", broker=os.environ["BENCH_BROKER"], backend=os.environ["BENCH_BROKER"])
    app.conf.update(redlock_masters=os.environ["BENCH_MASTERS"], worker_prefetch_multiplier=16)
    if os.environ.get("BENCH_LINGER"):
        app.conf.redlock_release_linger = float(os.environ["BENCH_LINGER"])

    @app.task(name="bench.plain")
    def plain(i):
        return i

    @app.task(base=RedlockTask, lock_key="bench:<i>", name="bench.locked")
    def locked(i):
        return i
''')


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
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per batch")
    parser.add_argument("--rounds", type=int, default=5, help="plain+locked batch pairs")
    parser.add_argument("--pools", default="solo,prefork")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children")
    parser.add_argument("--linger", type=float, default=None,
                        help="redlock_release_linger for the worker (default: the setting's)")
    parser.add_argument("--masters", default="5",
                        help="comma-separated lock master counts to measure, e.g. 1,3,5")
    args = parser.parse_args()
    counts = [int(n) for n in args.masters.split(",")]

    workdir = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    (workdir / "benchapp.py").write_text(APP_SOURCE)
    rows = []
    with RedisServer() as broker, ServerSet(max(counts)) as masters:
        client = Celery("bench-client", broker=broker.url, backend=broker.url)
        for count in counts:
            env = {"BENCH_BROKER": broker.url, "BENCH_MASTERS": ",".join(masters.urls[:count]),
                   "BENCH_LINGER": "" if args.linger is None else str(args.linger)}
            pids = [pid for pid in (m.pid for m in list(masters)[:count]) if pid is not None]
            for pool in args.pools.split(","):
                rows.append((count, pool, *measure(client, pool, args, env, workdir, pids)))
        client.close()
    print(f"{args.tasks} no-op tasks per batch, {args.rounds} rounds of a plain and a locked batch "
          f"(alternating which goes first), python {sys.version.split()[0]}; ratio: median over "
          "rounds of locked/plain throughput")
    print(f"{'masters':>7}  {'pool':<9}{'plain tasks/s':>14}{'locked tasks/s':>16}{'ratio':>7}"
          f"{'lock ms/task':>14}{'worker CPU':>12}{'masters CPU':>13}")
    for count, pool, plain_rate, locked_rate, ratio, overhead, worker_cpu, master_cpu in rows:
        print(f"{count:>7}  {pool:<9}{plain_rate:>14.0f}{locked_rate:>16.0f}{ratio:>7.2f}"
              f"{overhead:>14.2f}{worker_cpu:>12.2f}{master_cpu:>13.2f}")
    print("lock ms/task: extra wall time per task per worker slot, (locked - plain) / tasks x "
          "concurrency")
    print("worker CPU, masters CPU: CPU ms per task the lock added to the worker (all its "
          "processes) and to the masters")


def measure(client: Celery, pool: str, args: argparse.Namespace, env: dict[str, str],
            workdir: Path, master_pids: list[int]) -> tuple[float, ...]:
    """(plain tasks/s, locked tasks/s, ratio, lock ms per task, worker and masters CPU ms per
    task added by the lock) for one pool, same worker."""
    queue = f"bench-{pool}-{os.getpid()}-{len(env['BENCH_MASTERS'])}"
    concurrency = args.concurrency if pool == "prefork" else 1
    worker = CeleryWorker("benchapp", pool=pool, concurrency=concurrency, queues=[queue],
                          env=env, pythonpath=[str(workdir)], loglevel="WARNING")
    # WARNING keeps per-task log lines out of the timing; readiness then comes from a ping.
    worker.start(wait=False)
    try:
        wait_pinged(client, worker)
        run_batch(client, "bench.plain", 50, queue)  # warm up connections and pool
        run_batch(client, "bench.locked", 50, queue, first=-50)
        assert worker.pid is not None
        worker_pids = [worker.pid, *worker.child_pids()]
        took = {"bench.plain": 0.0, "bench.locked": 0.0}
        cpu = {(name, who): 0.0 for name in took for who in ("worker", "masters")}
        ratios = []
        for round_ in range(args.rounds):
            first = round_ * args.tasks  # a fresh key per locked task: no lock is ever reused
            order = ("bench.plain", "bench.locked") if round_ % 2 == 0 else (
                "bench.locked", "bench.plain")
            this_round = {}
            for name in order:
                before = cpu_seconds(worker_pids), cpu_seconds(master_pids)
                this_round[name] = run_batch(client, name, args.tasks, queue, first)
                cpu[name, "worker"] += cpu_seconds(worker_pids) - before[0]
                cpu[name, "masters"] += cpu_seconds(master_pids) - before[1]
                took[name] += this_round[name]
            ratios.append(this_round["bench.plain"] / this_round["bench.locked"])
    finally:
        worker.stop()
    tasks = args.rounds * args.tasks
    plain, locked = took["bench.plain"], took["bench.locked"]

    def added(who: str) -> float:
        return (cpu["bench.locked", who] - cpu["bench.plain", who]) / tasks * 1000

    return (tasks / plain, tasks / locked, statistics.median(ratios),
            (locked - plain) / tasks * 1000 * concurrency, added("worker"), added("masters"))

if __name__ == "__main__":
    main()
