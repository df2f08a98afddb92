"""Who holds a lock: the holder record stored beside its token, and how it reads in a message.

The Celery layer writes a JSON record (task id and name, host, pid, since, ttl) as the holder
text of each run's lock, in the acquire's own SET; ``Redlock.lock(..., holder=...)`` users may
write any text. Parsing never fails: text that is not such a record is kept as it is.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Holder:
    """Who took a lock, as recorded beside its token (see the module docstring)."""

    text: str
    task: str | None = None
    name: str | None = None
    host: str | None = None
    pid: int | None = None
    since: float | None = None
    ttl: float | None = None

    @classmethod
    def parse(cls, text: str) -> Holder:
        try:
            record = json.loads(text) if text.startswith("{") else None
        except ValueError:
            record = None
        if not isinstance(record, dict):
            return cls(text)

        def field(key: str, kind: type | tuple[type, ...]) -> Any:
            value = record.get(key)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        return cls(
            text,
            task=field("task", str),
            name=field("name", str),
            host=field("host", str),
            pid=field("pid", int),
            since=_float(field("since", (int, float))),
            ttl=_float(field("ttl", (int, float))),
        )

    def age(self, at: float | None = None) -> float | None:
        """Seconds since it was taken (by this machine's clock), when the record says when."""
        if self.since is None:
            return None
        return max(0.0, (time.time() if at is None else at) - self.since)

    def describe(self, at: float | None = None) -> str:
        """``task charge_invoice 8c1f... on worker-3 pid 4411 for 12.4 s``, or the text."""
        if self.task is None and self.host is None and self.pid is None:
            return repr(self.text) if self.text else "an unnamed holder"
        parts = []
        if self.task is not None or self.name is not None:
            parts.append(" ".join(["task", *(p for p in (self.name, self.task) if p)]))
        if self.host is not None:
            parts.append(f"on {self.host}")
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        age = self.age(at)
        if age is not None:
            parts.append(f"for {age:.1f} s")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def describe_holder(text: str | None) -> str:
    """How a holder text reads in a message: ``task <name> <id> on <host> pid <pid> for <s> s``."""
    return "" if text is None else Holder.parse(text).describe()
