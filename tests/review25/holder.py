"""A lock holder in a process of its own, run as a script by the review's tests.

``python holder.py hold SPEC``: takes SPEC's lock with a record written as the Celery layer
writes it (this host's name, this process's pid, the TTL, the heartbeat interval), keeps it with
the process heartbeat, prints ``ready <token> <pid>`` and then obeys stdin: ``gil S`` runs about S
seconds of one C call that holds the GIL (``sum(range(n))``, printing ``busy`` first), then prints
``owned <bool> <validity>``; ``owned`` prints that at once.

``python holder.py ns SPEC`` (as pid 1 of a new pid namespace): sets the namespace's next pid to
SPEC's ``pid`` and runs ``hold`` as that pid, with this process's stdin and stdout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from celery_redlock import Redlock
from celery_redlock.lock.heartbeat import process_heartbeat
from celery_redlock.lock.holder import HolderRecord


def _loops_per_second() -> float:
    n = 2_000_000
    started = time.perf_counter()
    sum(range(n))
    return n / max(1e-6, time.perf_counter() - started)


def hold(spec: dict[str, Any]) -> int:
    rate = _loops_per_second()
    record = HolderRecord(
        name="review25.charge",
        host=socket.gethostname(),
        pid=os.getpid(),
        ttl=spec["ttl"],
        heartbeat=spec["every"],
    ).to_text(task="8c1f0000-0000-4000-8000-000000000025", since=time.time())
    with Redlock(spec["urls"], retry_count=0) as rl:
        lock = rl.lock(spec["name"], ttl=spec["ttl"], holder=record)
        if not lock.acquire(blocking=False):
            print("refused", flush=True)
            return 1
        process_heartbeat().keep(lock, interval=spec["every"])
        print(f"ready {lock.token} {os.getpid()}", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words and words[0] == "gil":
                print("busy", flush=True)
                sum(range(int(rate * float(words[1]))))  # one C call: the GIL is never let go
            print(f"owned {lock.owned()} {lock.validity:.2f}", flush=True)
    return 0


def namespace(spec: dict[str, Any]) -> int:
    with open("/proc/sys/kernel/ns_last_pid", "w") as last:
        last.write(str(spec["pid"] - 1))
    return subprocess.call([sys.executable, __file__, "hold", json.dumps(spec)])


if __name__ == "__main__":
    role, raw = sys.argv[1], json.loads(sys.argv[2])
    sys.exit(hold(raw) if role == "hold" else namespace(raw))
