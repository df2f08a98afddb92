"""The shared register the workload updates inside each hold, and the history of every hold.

Both live on one server that is *not* a lock master and is never faulted, so whatever it shows
was done by the clients. The register is a plain counter per resource, updated read-modify-write
(GET, a pause, SET) so two holders that overlap lose an update; every write is also appended to a
log, so the checker can count how many writes there were and which ones collided.
"""

from __future__ import annotations

import json
from typing import Any

import redis

HISTORY = "history"  # one JSON record per hold and one summary per client
EVENTS = "events"  # client-pause events: paused, resumed
CELERY_FAILURES = "celery-failures"  # hash: reason -> failed attempts of RedlockTask runs
PAUSE_REQUEST = "pause-request"  # set by the nemesis; the next process client holding a lock takes it


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

    def log(self, resource: str) -> list[tuple[int, str]]:
        entries = []
        for raw in self.client.lrange(f"log:{resource}", 0, -1):
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            value, who = text.split(" ", 1)
            entries.append((int(value), who))
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
