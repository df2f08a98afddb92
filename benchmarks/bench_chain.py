"""Same-key chain through Celery: how long 20 duplicates of a 50 ms locked body take to drain.

Run:  python benchmarks/bench_chain.py [--duplicates 20] [--body 0.05] [--rounds 3]

Two prefork workers with 2 children each, a real broker and five masters (all started here). The
duplicates all lock one name, so they must run one after another: the serial bound is
``duplicates x body`` (1.0 s by default). Measured from the first send to the last result, for
``lock_contended="wait"`` (a duplicate waits in its worker, woken by the release) and for
``"retry"`` (it is re-published after a jittered backoff, the default 1 s base). Issue 16's goal:
wait mode under 1.5x the bound.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

from celery import Celery

from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

APP_SOURCE = textwrap.dedent("""
    import os
    import time

    from celery import Celery

    from celery_redlock import RedlockTask

    app = Celery("chainapp", broker=os.environ["BENCH_BROKER"], backend=os.environ["BENCH_BROKER"])
    app.conf.update(redlock_masters=os.environ["BENCH_MASTERS"], worker_prefetch_multiplier=1)
    BODY = float(os.environ["BENCH_BODY"])

    @app.task(base=RedlockTask, lock_key="chain:<run>", lock_contended="wait", name="chain.wait")
    def wait(run, i):
        time.sleep(BODY)
        return i

    @app.task(base=RedlockTask, lock_key="chain:<run>", lock_contended="retry", name="chain.retry")
    def retry(run, i):
        time.sleep(BODY)
        return i
""")


def drain(client: Celery, task: str, run: str, count: int) -> float:
    started = time.perf_counter()
    results = [client.send_task(task, (run, i), queue="chain") for i in range(count)]
    for result in results:
        result.get(timeout=300)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duplicates", type=int, default=20)
    parser.add_argument("--body", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-chain-"))
    (workdir / "chainapp.py").write_text(APP_SOURCE)
    bound = args.duplicates * args.body
    times: dict[str, list[float]] = {"chain.wait": [], "chain.retry": []}
    with RedisServer() as broker, ServerSet(5) as masters:
        env = {
            "BENCH_BROKER": broker.url,
            "BENCH_MASTERS": ",".join(masters.urls),
            "BENCH_BODY": str(args.body),
        }
        workers = [
            CeleryWorker("chainapp", pool="prefork", concurrency=2, queues=["chain"], env=env,
                         pythonpath=[str(workdir)])
            for _ in range(2)
        ]  # fmt: skip
        client = Celery("chain-client", broker=broker.url, backend=broker.url)
        try:
            for worker in workers:
                worker.start()
            drain(client, "chain.wait", "warm-up", 4)  # connections and subscribers made
            for n in range(args.rounds):
                for task in times:
                    times[task].append(drain(client, task, f"{task}-{n}", args.duplicates))
        finally:
            client.close()
            for worker in workers:
                worker.stop()
    print(
        f"{args.duplicates} duplicates of a {args.body * 1000:.0f} ms body, prefork 2 workers x 2, "
        f"median of {args.rounds}; serial bound {bound:.2f} s"
    )
    print("| lock_contended | drain s | / bound |")
    print("|---|--:|--:|")
    for task, samples in times.items():
        median = statistics.median(samples)
        print(f"| {task.split('.')[1]} | {median:.2f} | {median / bound:.2f}x |")


if __name__ == "__main__":
    main()
