"""The HA beat's leader record, as anyone reads it: ``<lock key>:leader`` on every master, a JSON
object (hostname, pid, since, lock, ttl, ...) written by the leader beside its lock with the
lock's TTL (:mod:`celery_redlock.celery.leader` writes it). Read here, below the Celery layer,
so the standalone ``celery-redlock leader`` needs no Celery app.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..lock.redlock import Redlock
from ..lock.resource import lock_key

LEADER_SUFFIX = ":leader"


def record_key(redlock: Redlock, lock_name: str) -> str:
    """Where the leader record of the lock ``lock_name`` is kept: beside the lock's own key."""
    return lock_key(redlock.key_prefix, lock_name) + LEADER_SUFFIX


@dataclass(frozen=True)
class LeaderReading:
    """Every master's copy of one leader record, counted: ``record`` is the one a quorum agrees
    on (None: none does), ``answered`` how many masters replied at all (absent or not)."""

    lock: str  # the leader lock's key
    key: str  # the record's key, beside it
    record: dict[str, Any] | None
    answered: int
    masters: int
    quorum: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "lock": self.lock,
            "key": self.key,
            "leader": self.record,
            "answered": self.answered,
            "masters": self.masters,
            "quorum": self.quorum,
        }


def read_leader_record(redlock: Redlock, lock_name: str, *, timeout: float | None = None) -> LeaderReading:
    """One GET of the leader record on every master (one round, by ``timeout``, default the
    Redlock's request_timeout), and the record a quorum of them agrees on."""
    key = record_key(redlock, lock_name)
    with redlock._round() as rnd:
        outcomes = rnd.call([("GET", key)] * len(redlock.masters), timeout or redlock.request_timeout)
    answers = [o.value for o in outcomes if o.kind == "ok"]
    counts = Counter(value for value in answers if value is not None)
    record = None
    if counts:
        value, votes = counts.most_common(1)[0]
        if votes >= redlock.quorum:
            record = json.loads(value)
    return LeaderReading(
        lock_key(redlock.key_prefix, lock_name),
        key,
        record,
        len(answers),
        len(redlock.masters),
        redlock.quorum,
    )


def read_leader(redlock: Redlock, lock_name: str) -> dict[str, Any] | None:
    """The current leader's record (hostname, pid, since, ...), if a quorum of masters agrees."""
    return read_leader_record(redlock, lock_name).record
