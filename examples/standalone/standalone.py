"""Redlock without Celery: several processes update one shared record, one at a time.

Run it with no arguments to start five embedded masters (needs ``celery-redlock[embedded]``),
or point it at your own five independent masters:

    python examples/standalone/standalone.py
    python examples/standalone/standalone.py redis://m1:6379 redis://m2:6379 redis://m3:6379 \
        redis://m4:6379 redis://m5:6379

Each worker process does a read-modify-write of a counter in a plain file, which is only correct
if no two processes are inside at once. The lock makes it so: the final count equals the number
of increments, and the exit status is 0 only then.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from celery_redlock import LockLost, LockNotAcquired, Redlock, process_heartbeat

RESOURCE = "ledger:standalone-example"


def add_one(masters: list[str], counter: Path, rounds: int) -> None:
    """One worker: ``rounds`` times, take the lock, read the counter, write it plus one."""
    with Redlock(masters, ttl=5.0) as redlock:
        for _ in range(rounds):
            lock = redlock.lock(RESOURCE, timeout=30)
            with lock:  # blocks (with jittered retries) until a quorum grants it, else raises
                value = int(counter.read_text())
                time.sleep(0.002)  # widen the window a second writer would need
                lock.ensure()  # raise LockLost rather than write after the validity ran out
                counter.write_text(str(value + 1))


def show_contention(masters: list[str]) -> None:
    """A second holder is refused, and the error says what each master answered."""
    with Redlock(masters, ttl=5.0, retry_count=0) as redlock, redlock.lock("report:q3") as held:
        print(f"holding {held.name!r}: {held.validity:.2f}s of validity, quorum {redlock.quorum}")
        try:
            with redlock.lock("report:q3"):
                raise AssertionError("a second holder got the lock")
        except LockNotAcquired as refused:
            print(
                f"second holder refused: {sum(v.kind == 'held' for v in refused.votes)} "
                f"masters answered 'held'"
            )


def show_heartbeat(masters: list[str]) -> None:
    """A hold three times longer than the TTL, kept alive by the process heartbeat."""
    with Redlock(masters) as redlock:
        lock = redlock.lock("report:long", ttl=0.6)
        lost: list[str] = []
        with lock:
            process_heartbeat().keep(lock, on_lost=lambda _lock, reason: lost.append(reason))
            try:
                for _step in range(3):
                    time.sleep(0.6)  # one step of real work, as long as the whole TTL
                    lock.ensure()
            except LockLost as error:
                print(f"lost the lock mid-job: {error}")
            finally:
                process_heartbeat().forget(lock)
        print(f"1.8 s of work under a 0.6 s TTL: {'kept' if not lost else 'lost: ' + lost[0]}")


@contextlib.contextmanager
def masters_for(urls: list[str]) -> Iterator[list[str]]:
    """The given masters, or five embedded ones for the length of the block."""
    if urls:
        yield urls
        return
    from celery_redlock.testing import ServerSet

    with ServerSet(5) as servers:
        yield servers.urls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("masters", nargs="*", help="redis:// URLs of independent masters")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args(argv)

    with masters_for(args.masters) as masters, tempfile.TemporaryDirectory() as tmp:
        show_contention(masters)
        show_heartbeat(masters)

        counter = Path(tmp) / "counter"
        counter.write_text("0")
        started = time.monotonic()
        context = multiprocessing.get_context("spawn")
        workers = [
            context.Process(target=add_one, args=(masters, counter, args.rounds)) for _ in range(args.workers)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        expected = args.workers * args.rounds
        final = int(counter.read_text())
        failed = [w.exitcode for w in workers if w.exitcode != 0]
        print(
            f"{args.workers} processes x {args.rounds} locked increments: counter = {final} "
            f"(expected {expected}) in {time.monotonic() - started:.2f}s"
        )
        if failed or final != expected:
            print(f"FAILED: exit codes {failed}, lost updates {expected - final}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
