"""Run the long job twice on real processes: once to the end, once losing its lock mid-way.

    python examples/long_running/run.py

Starts five embedded masters, an embedded broker and one worker (needs celery-redlock[embedded]),
and stops them all on the way out.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from celery.result import AsyncResult

from celery_redlock import LockLost
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

HERE = Path(__file__).resolve().parent


def wait_for_step(result: AsyncResult, step: int, timeout: float) -> int:
    """Poll the job's PROGRESS state until it reports ``step``; the step it reported."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = result.info
        if isinstance(info, dict) and info.get("step", 0) >= step:
            return int(info["step"])
        time.sleep(0.05)
    raise TimeoutError(f"the job did not reach step {step} within {timeout}s")


def main() -> int:
    with ServerSet(5) as masters, RedisServer() as broker:
        env = {
            "CELERY_BROKER_URL": broker.url,
            "CELERY_RESULT_BACKEND": broker.url,
            "REDLOCK_MASTERS": ",".join(masters.urls),
        }
        os.environ.update(env)
        sys.path.insert(0, str(HERE))
        import tasks

        with CeleryWorker("tasks", concurrency=1, env=env, cwd=HERE, pythonpath=[HERE]):
            print(tasks.reconcile.delay("2026-q1", steps=10).get(timeout=30))

            doomed = tasks.reconcile.delay("2026-q2", steps=40)
            reached = wait_for_step(doomed, 2, timeout=30)
            for server in masters[:3]:
                server.kill()
            print(
                f"killed 3 of 5 masters at step {reached} of the second job: "
                "no quorum is left to extend its lock"
            )
            try:
                doomed.get(timeout=30)
            except LockLost as lost:
                # Through a JSON result backend the error arrives rebuilt from its message alone.
                print(f"second job stopped before writing again: LockLost: {lost.reason or lost.resource}")
                return 0
            print("the second job finished although its lock could not be kept", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
