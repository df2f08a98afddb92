"""docs/pools.md: "run it on prefork (or threads, where the GIL is switched every 5 ms whatever the
body does): its heartbeat is a real thread." The GIL is switched between bytecodes only: a body
inside one long C call that holds the GIL (``sum(range(n))``, ``sorted`` of a big list, a regex
backtracking) starves the heartbeat thread as a CPU-bound green body starves its green one, and
the lock expires under a body that still runs: another client takes it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import RedisServer, ServerSet

from .conftest import Workers

KNOWN_LIMIT = (
    "known limit (docs/pools.md): a C call that holds the GIL longer than the lock TTL starves "
    "the heartbeat; use a TTL above the longest such call, or fencing"
)


@pytest.mark.xfail(
    strict=True,
    reason=KNOWN_LIMIT,
)
@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_no_client_takes_the_lock_of_a_body_inside_one_long_c_call(
    review_app: Any,
    review_workers: Workers,
    review_servers: tuple[RedisServer, ServerSet],
    tag: str,
    pool: str,
) -> None:
    queue = review_workers(pool, 4 if pool == "threads" else 2)
    _, masters = review_servers
    # About 5 s of C here (2 s of TTL, extended every 0.67 s by the heartbeat if it could run).
    result = review_app.summer.apply_async((tag, 250_000_000), queue=queue)
    deadline = time.monotonic() + 30
    while not any(e["event"] == "start" for e in review_app.events(tag)):
        assert time.monotonic() < deadline, "the body never started"
        time.sleep(0.02)
    taken_at = None
    with Redlock(masters.urls) as rl:
        contender = rl.lock(f"r:{tag}", ttl=5)
        while not result.ready() and time.monotonic() < deadline:
            if contender.acquire(blocking=False):
                taken_at = time.time()
                contender.release()
                break
            time.sleep(0.02)
    result.get(timeout=30, propagate=False)
    end = next((e for e in review_app.events(tag) if e["event"] == "end"), None)
    late = (end["t"] - taken_at) if end and taken_at else 0.0
    assert taken_at is None or (end is not None and end["t"] <= taken_at), (
        f"another client took the lock while the body ran ({pool}); the body ended {late:.1f} s "
        f"later, saying owned={end and end['owned']}"
    )
