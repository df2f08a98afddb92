"""A publisher process: ``python -m tests.enqueue_lost.publisher <key> <queue>`` publishes
``elost.deduped(key)`` (lock_enqueue) with the environment's broker and masters, with long
broker timeouts (a test makes its broker unreachable, and kills it while it hangs)."""

from __future__ import annotations

import os
import sys

from .app import app, deduped

if __name__ == "__main__":
    app.conf.update(
        broker_url=os.environ["ELOST_BROKER"],
        result_backend=os.environ["ELOST_BACKEND"],
        redlock_masters=os.environ["ELOST_MASTERS"],
        broker_connection_timeout=60,
        broker_transport_options={"socket_timeout": 60, "socket_connect_timeout": 60},
    )
    print("publishing", flush=True)
    result = deduped.apply_async((sys.argv[1],), queue=sys.argv[2])
    print("published", result.id, flush=True)
