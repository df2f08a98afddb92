"""The shared register the workload updates inside each hold, and the history of every hold.

Both live on one server that is *not* a lock master and is never faulted, so whatever it shows
was done by the clients. The register is a plain counter per resource, updated read-modify-write
(GET, a pause, SET) so two holders that overlap lose an update; every write is also appended to a
log, so the checker can count how many writes there were and which ones collided.

A *fenced* resource (``fres<i>``) is the same counter behind the shipped resource helper,
``celery_redlock.fenced.FencedKey``: a hold claims and reads in one script under its lock's fence,
and writes only if no higher fence has been seen. Its log entries carry the fence, so the checker
can replay the accepted writes in fence order; a refusal (``StaleFence``) is counted in
``refused:<resource>`` and appends nothing.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from celery_redlock.errors import StaleFence
from celery_redlock.fenced import FencedKey

HISTORY = "history"  # one JSON record per hold and one summary per client
EVENTS = "events"  # client-pause events: paused, resumed
CELERY_FAILURES = "celery-failures"  # hash: reason -> failed attempts of RedlockTask runs
PAUSE_REQUEST = "pause-request"  # set by the nemesis; the next process client holding a lock takes it
STALE_REQUEST = "stale-request:"  # + "<thread|process>:<plain|fenced>": the stale-writer nemesis's ask
FENCED_PREFIX = "fres"  # a resource named so is a fenced one, locked with fenced=True


def is_fenced(resource: str) -> bool:
    return resource.startswith(FENCED_PREFIX)


class Register:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)

    def close(self) -> None:
        self.client.close()

    # -- the register (inside a hold) ---------------------------------------------------------------
    def read(self, resource: str) -> int:
        value = self.client.get(f"count:{resource}")
        return int(value) if value is not None else 0

    def write(self, resource: str, value: int, who: str) -> None:
        self.client.set(f"count:{resource}", value)
        self.client.rpush(f"log:{resource}", f"{value} {who}")

    def fenced_read(self, resource: str, fence: int) -> int:
        """Claim a fenced resource for ``fence`` and read it; ``StaleFence`` if a higher fence
        has been seen (counted as a refusal)."""
        try:
            value = self._fenced(resource).read(fence)
        except StaleFence:
            self.client.incr(f"refused:{resource}")
            raise
        return int(value) if value is not None else 0

    def fenced_write(self, resource: str, fence: int, value: int, who: str) -> None:
        """Write a fenced resource under ``fence``, then log it; ``StaleFence`` (counted, not
        logged) if a higher fence has been seen."""
        try:
            self._fenced(resource).write(fence, str(value))
        except StaleFence:
            self.client.incr(f"refused:{resource}")
            raise
        self.client.rpush(f"log:{resource}", f"{value} {who} {fence}")

    def _fenced(self, resource: str) -> FencedKey:
        return FencedKey(self.client, f"count:{resource}")

    def refused(self, resource: str) -> int:
        return int(self.client.get(f"refused:{resource}") or 0)

    def log(self, resource: str) -> list[tuple[int, str]]:
        return [(value, who) for value, who, _ in self.fenced_log(resource)]

    def fenced_log(self, resource: str) -> list[tuple[int, str, int | None]]:
        """(value, who, fence) per logged write, in log order; fence is None on a plain resource."""
        entries: list[tuple[int, str, int | None]] = []
        for raw in self.client.lrange(f"log:{resource}", 0, -1):
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            value, who, *fence = text.split(" ")
            entries.append((int(value), who, int(fence[0]) if fence else None))
        return entries

    def log_length(self, resource: str) -> int:
        return int(self.client.llen(f"log:{resource}"))

    # -- history and events -----------------------------------------------------------------------
    def record(self, entry: dict[str, Any], key: str = HISTORY) -> None:
        self.client.rpush(key, json.dumps(entry))

    def records(self, key: str = HISTORY, start: int = 0) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.client.lrange(key, start, -1)]

    def count(self, key: str = HISTORY) -> int:
        return int(self.client.llen(key))

    def request_pause(self) -> None:
        self.client.set(PAUSE_REQUEST, "1")

    def take_pause_request(self) -> bool:
        return self.client.getdel(PAUSE_REQUEST) is not None

    def request_stale_write(self, kind: str, resources: str) -> None:
        """Ask the next ``kind`` client (thread or process) holding a ``resources`` (plain or
        fenced) resource to pause between its last ensure() and its write."""
        self.client.set(f"{STALE_REQUEST}{kind}:{resources}", "1")

    def take_stale_request(self, kind: str, resources: str) -> bool:
        return self.client.getdel(f"{STALE_REQUEST}{kind}:{resources}") is not None
