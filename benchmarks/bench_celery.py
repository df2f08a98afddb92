"""Throughput of no-op tasks through a real worker, plain vs RedlockTask (5 masters), same run.

    /tmp/venv/bin/python benchmarks/bench_celery.py [--tasks 2000] [--pools solo,prefork]

Starts its own broker/backend server and five lock masters on free loopback ports, and one real
``celery worker`` per pool. For each pool it sends N plain no-op tasks, then N locked no-op tasks
(distinct keys), and times from the first send until every result is in. Prints a table with the
locked/plain ratio and the per-task lock overhead (extra wall time per task, in ms).
"""

from __future__ import annotations

import argparse
import os
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

    @app.task(name="bench.plain")
    def plain(i):
        return i

    @app.task(base=RedlockTask, lock_key="bench:<i>", name="bench.locked")
    def locked(i):
        return i
''')


def run_batch(app: Celery, name: str, count: int, queue: str) -> float:
    started = time.perf_counter()
    results = [app.send_task(name, (i,), queue=queue) for i in range(count)]
    for result in results:
        result.get(timeout=300)
    return time.perf_counter() - started


def wait_pinged(client: Celery, worker: CeleryWorker, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.control.ping(destination=[worker.hostname], timeout=0.5):
        if not worker.running or time.monotonic() > deadline:
            worker.kill()
            raise RuntimeError(f"{worker!r} did not answer a ping: {worker.log_tail()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--pools", default="solo,prefork")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork children")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    (workdir / "benchapp.py").write_text(APP_SOURCE)
    rows = []
    with RedisServer() as broker, ServerSet(5) as masters:
        env = {"BENCH_BROKER": broker.url, "BENCH_MASTERS": ",".join(masters.urls)}
        client = Celery("bench-client", broker=broker.url, backend=broker.url)
        for pool in args.pools.split(","):
            queue = f"bench-{pool}-{os.getpid()}"
            concurrency = args.concurrency if pool == "prefork" else 1
            worker = CeleryWorker("benchapp", pool=pool, concurrency=concurrency, queues=[queue],
                                  env=env, pythonpath=[str(workdir)], loglevel="WARNING")
            # WARNING keeps per-task log lines out of the timing; readiness then comes from a ping.
            worker.start(wait=False)
            try:
                wait_pinged(client, worker)
                run_batch(client, "bench.plain", 50, queue)  # warm up connections and pool
                run_batch(client, "bench.locked", 50, queue)
                plain = run_batch(client, "bench.plain", args.tasks, queue)
                locked = run_batch(client, "bench.locked", args.tasks, queue)
            finally:
                worker.stop()
            rows.append((pool, args.tasks / plain, args.tasks / locked, plain / locked,
                         (locked - plain) / args.tasks * 1000 * concurrency))
        client.close()
    print(f"{args.tasks} no-op tasks per run, 5 lock masters, python {sys.version.split()[0]}")
    print(f"{'pool':<10}{'plain tasks/s':>15}{'locked tasks/s':>16}{'ratio':>8}{'lock ms/task':>14}")
    for pool, plain_rate, locked_rate, ratio, overhead in rows:
        print(f"{pool:<10}{plain_rate:>15.0f}{locked_rate:>16.0f}{ratio:>8.2f}{overhead:>14.2f}")
    print("lock ms/task: extra wall time per task per worker slot (locked - plain) / N x concurrency")


if __name__ == "__main__":
    main()
