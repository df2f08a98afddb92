"""The Celery variant's workload: real ``celery worker`` processes and a producer that keeps them
busy with ``faults.rmw`` calls (``faults.rmw_fenced`` on a fenced resource), so the executions
contend for the resources' locks."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from celery import Celery

from celery_redlock.testing import CeleryWorker

from .register import EVENTS, Register, is_fenced

CONCURRENCY = 2
# After production stops: how long the tasks still queued or retrying get to end. Draining takes
# a few seconds (a few holds per pool child, plus lock retries); the nemesis has stopped by then.
DRAIN_TIMEOUT = 30.0


@contextmanager
def celery_workers(
    count: int,
    *,
    package: str,
    root: Path,
    broker: str,
    register: str,
    masters: Sequence[str],
    ttl: float,
    key_prefix: str,
    queue: str,
    stale: bool = False,
) -> Iterator[list[CeleryWorker]]:
    env = {
        "FAULTS_BROKER": broker,
        "FAULTS_REGISTER": register,
        "FAULTS_MASTERS": ",".join(masters),
        "FAULTS_TTL": str(ttl),
        "FAULTS_KEY_PREFIX": key_prefix,
        "FAULTS_QUEUE": queue,
        "FAULTS_STALE": "1" if stale else "0",
    }
    workers: list[CeleryWorker] = []
    try:
        for _ in range(count):
            worker = CeleryWorker(
                f"{package}.celery_app",
                pool="prefork",
                concurrency=CONCURRENCY,
                queues=[queue],
                env=env,
                pythonpath=[str(root)],
                loglevel="INFO",
            )
            workers.append(worker)
            worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.stop()
            worker.cleanup()


def produce(
    broker: str,
    queue: str,
    register: Register,
    resources: Sequence[str],
    hold: tuple[float, float],
    ttl: float,
    until: float,
    rng: random.Random,
    outstanding: int,
) -> int:
    """Publish ``faults.rmw`` calls until ``until``, keeping about ``outstanding`` unfinished
    (a contended call is republished by the task itself and stays unfinished), then wait until
    every one has ended (see :func:`drain`). Returns how many.

    Each task id is recorded as a ``published`` event: the checker counts as lost work every
    published task that did not end exactly once (see ``checker.lost_work``)."""
    producer = Celery("faults-producer", broker=broker)
    published = 0
    try:
        while time.monotonic() < until:
            finished = register.count()
            for _ in range(max(0, outstanding - (published - finished))):
                resource = rng.choice(list(resources))
                task_id = uuid.uuid4().hex
                producer.send_task(
                    "faults.rmw_fenced" if is_fenced(resource) else "faults.rmw",
                    args=[resource, rng.uniform(*hold) * ttl],
                    queue=queue,
                    task_id=task_id,
                )
                register.record({"kind": "published", "task_id": task_id}, key=EVENTS)
                published += 1
            time.sleep(0.05)  # pacing the producer's polls, not synchronisation
    finally:
        producer.close()
    drain(register, time.monotonic() + DRAIN_TIMEOUT)
    return published


def drain(register: Register, deadline: float) -> bool:
    """Wait until every published task has ended (a hold recorded, or refused for good), or the
    deadline: the tasks still queued or retrying when production stops are not lost, only not
    finished yet, and the workers must not be stopped under them. True once all have ended; a
    task still unended at the deadline is reported as lost work by the checker."""
    while True:
        events = register.records(EVENTS)
        published = {e["task_id"] for e in events if e["kind"] == "published"}
        ended = {e["task_id"] for e in events if e["kind"] == "gave-up"}
        ended |= {r.get("task_id") for r in register.records() if r["kind"] == "hold"}
        if published <= ended:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)  # pacing the polls of the register
