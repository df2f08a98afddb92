"""One workload client: contend for the resources, and inside each hold update the register.

Run as a thread (``run_client(config)``) or as its own process
(``python -m <package>.client '<json config>'``), which the client-pause nemesis can SIGSTOP.

Each attempt is one round (``acquire(blocking=False)``), so every failure is counted with its
reason; a ``waiting`` client instead blocks in ``acquire(timeout=ttl)``, woken by releases (a
``fair`` one the same, queued in arrival order: ``fair=True``), and a
``reentrant`` client takes a reentrant lock and enters it again once or twice before it writes.
Inside a hold the client checks ``ensure()`` before it reads and again before it writes;
sometimes it extends the lock, and sometimes it walks away without releasing (as a crashed
holder would), which makes holds end at their validity and exercises the TTL boundary.
Every hold is recorded with ``time.monotonic()``, one clock for the whole machine: ``t_invoked``
just before the acquire call, ``t_acquired`` just after it returned.

A fenced resource (``fres<i>``, see ``register``) is locked with ``fenced=True``: the hold claims
and reads it under ``lock.fence`` and writes under the same fence, and a ``StaleFence`` refusal
is recorded as the hold's loss. With ``extra["stale"]`` the client answers the stale-writer
nemesis: after its last ``ensure()`` it may pause (a thread sleeps until another client has
written the resource, a process SIGSTOPs itself until the nemesis resumes it), then writes
*without* another ``ensure()`` and reports whether the write was accepted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from celery_redlock import LockLost, LockNotAcquired, Redlock
from celery_redlock.errors import StaleFence
from celery_redlock.lock.owner import open_scope

from .register import EVENTS, Register, is_fenced


@dataclass
class ClientConfig:
    name: str
    masters: list[str]
    register: str
    resources: list[str]
    until: float  # time.monotonic() at which to stop
    seed: int
    ttl: float = 1.0
    request_timeout: float = 0.1
    key_prefix: str = "faults:"
    hold: tuple[float, float] = (0.05, 0.3)  # fraction of the TTL spent between read and write
    abandon: float = 0.05  # probability of leaving the lock to expire instead of releasing it
    extend: float = 0.2  # probability of extending once inside the hold
    backoff: float = 0.05  # random wait after a failed attempt, at most this
    pausable: bool = False  # a process client: may SIGSTOP itself when the nemesis asks
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ClientConfig:
        data = json.loads(text)
        data["hold"] = tuple(data["hold"])
        return cls(**data)


def failure_reason(error: LockNotAcquired | None) -> str:
    """Why one round failed: too slow (a quorum granted but no validity was left), contended
    (another token holds the key somewhere), or unreachable (errors and timeouts only)."""
    if error is None:
        return "unknown"
    yes = sum(1 for vote in error.votes if vote.kind == "yes")
    if yes >= error.quorum:
        return "too slow"
    if error.held_by_other:
        return "contended"
    return "unreachable"


PAUSE_MARGIN_TTLS = 4
STALE_THREAD_TTLS = 10  # the longest a thread keeps away in a stale-writer pause


def _votes(lock: Any) -> list[Any]:
    """The votes of the acquisition (a reentrant lock's are its holding's)."""
    holding = lock.holding() if hasattr(lock, "holding") else lock
    return list(holding.last_votes) if holding is not None else []


def run_client(config: ClientConfig) -> None:
    rng = random.Random(config.seed)
    register = Register(config.register)
    failures: Counter[str] = Counter()
    holds = 0
    with Redlock(
        config.masters,
        ttl=config.ttl,
        retry_count=0,
        request_timeout=config.request_timeout,
        key_prefix=config.key_prefix,
    ) as redlock:
        while time.monotonic() < config.until:
            resource = rng.choice(config.resources)
            mode = config.extra.get("mode", "plain")
            if mode == "reentrant":
                # Each hold is one owner (as each Celery execution is): a hold abandoned below
                # stands for a crashed one, and must not be re-entered by the next iteration.
                open_scope()
            fenced = is_fenced(resource)
            lock: Any = redlock.lock(
                resource, reentrant=mode == "reentrant", fair=mode == "fair", fenced=fenced
            )
            waits = mode in ("waiting", "fair")
            t_invoked = time.monotonic()
            got = lock.acquire(timeout=config.ttl) if waits else lock.acquire(blocking=False)
            depth = 1
            if got and mode == "reentrant":
                try:
                    for _ in range(rng.randint(1, 2)):  # the owner enters again: never blocks
                        lock.acquire(blocking=False)
                        depth += 1
                except LockLost:
                    pass  # held no longer: the ensure() below records it
            if not got:
                failures[failure_reason(lock.last_error)] += 1
                time.sleep(rng.uniform(0, config.backoff))  # pacing, not synchronisation
                continue
            holds += 1
            stale = False
            t_acquired = time.monotonic()
            validity_end = t_acquired + lock.validity
            record: dict[str, Any] = {
                "kind": "hold",
                "client": config.name,
                "resource": resource,
                "token": lock.token,
                "fence": lock.fence if fenced else None,
                "t_invoked": t_invoked,
                "t_acquired": t_acquired,
                "validity_end": validity_end,
                "t_released": None,
                "yes": sum(1 for v in _votes(lock) if v.kind == "yes"),
                "masters": len(_votes(lock)),
                "quorum": redlock.quorum,
                "wrote": False,
                "lost": "",
                "extended": False,
            }
            # Not in the run's last TTLs: the other clients stop contending at `until`, and the
            # check that someone took the resource during the pause would fail for that alone.
            if (
                config.pausable
                and config.until - time.monotonic() > PAUSE_MARGIN_TTLS * config.ttl
                and register.take_pause_request()
            ):
                _pause_self(register, config, lock, record)
            fence = record["fence"]
            who = f"{config.name}:{lock.token}"
            try:
                lock.ensure()
                value = register.fenced_read(resource, fence) if fenced else register.read(resource)
                time.sleep(rng.uniform(*config.hold) * config.ttl)  # the work, between read and write
                if rng.random() < config.extend and lock.extend():
                    record["validity_end"] = time.monotonic() + lock.validity
                    record["extended"] = True
                lock.ensure()
                kind = "process" if config.pausable else "thread"
                stale = bool(config.extra.get("stale")) and _stale_pause(register, config, kind, record)
                if fenced:
                    register.fenced_write(resource, fence, value + 1, who)
                else:
                    register.write(resource, value + 1, who)
                record["wrote"] = True
            except LockLost as exc:
                record["lost"] = exc.reason or "lost"
            except StaleFence as exc:
                record["lost"] = f"StaleFence: {exc.current} > {exc.fence}"
            if stale:
                _report_stale_write(register, config, record)
            if rng.random() >= config.abandon:
                # The holder is done once it starts releasing: another client may get the
                # lock before release() returns.
                record["t_released"] = time.monotonic()
                for _ in range(depth):  # a reentrant lock is freed by its last exit
                    lock.release()
            register.record(record)
    register.record({"kind": "summary", "client": config.name, "holds": holds, "failures": dict(failures)})
    register.close()


def _stale_pause(register: Register, config: ClientConfig, kind: str, record: dict[str, Any]) -> bool:
    """The stale-writer point, after the last ensure() and before the write: if the nemesis asks
    for a ``kind`` holder of this kind of resource, stay away from the resource (longer than the
    lock's validity, since someone else must take the lock and write meanwhile), then return True
    so the caller writes without another ensure()."""
    resources = "fenced" if record["fence"] is not None else "plain"
    if config.until - time.monotonic() <= PAUSE_MARGIN_TTLS * config.ttl:
        return False
    if not register.take_stale_request(kind, resources):
        return False
    resource = record["resource"]
    start_length = register.log_length(resource)
    t_paused = time.monotonic()
    register.record(
        {
            "kind": "stale-paused",
            "client": config.name,
            "pid": os.getpid(),
            "process": kind == "process",
            "resource": resource,
            "token": record["token"],
            "fence": record["fence"],
            "t": t_paused,
            "validity_end": record["validity_end"],
        },
        key=EVENTS,
    )
    if kind == "process":
        os.kill(os.getpid(), signal.SIGSTOP)  # the nemesis resumes it after a takeover
    else:
        # A thread cannot be stopped: it keeps away from the resource, polling with a deadline,
        # until another client has written it (which needs this lock expired) or 10 TTLs passed.
        deadline = t_paused + STALE_THREAD_TTLS * config.ttl
        while register.log_length(resource) == start_length and time.monotonic() < deadline:
            time.sleep(0.01)
    record["stale"] = True
    record["t_resumed"] = time.monotonic()
    return True


def _report_stale_write(register: Register, config: ClientConfig, record: dict[str, Any]) -> None:
    register.record(
        {
            "kind": "stale-write",
            "client": config.name,
            "resource": record["resource"],
            "token": record["token"],
            "fence": record["fence"],
            "t": time.monotonic(),
            "t_resumed": record["t_resumed"],
            "validity_end": record["validity_end"],
            "accepted": record["wrote"],
            "refused": record["lost"],
        },
        key=EVENTS,
    )


def _pause_self(register: Register, config: ClientConfig, lock: Any, record: dict[str, Any]) -> None:
    """SIGSTOP this process while holding, before touching the register; the nemesis resumes it
    once another client has taken the resource. Then report what the lock says."""
    register.record(
        {
            "kind": "paused",
            "client": config.name,
            "pid": os.getpid(),
            "resource": record["resource"],
            "token": lock.token,
            "t": time.monotonic(),
            "validity_end": record["validity_end"],
        },
        key=EVENTS,
    )
    os.kill(os.getpid(), signal.SIGSTOP)
    owned = lock.owned()
    try:
        lock.ensure()
        raised = ""
    except LockLost as exc:
        raised = f"LockLost: {exc.reason}"
    register.record(
        {
            "kind": "resumed",
            "client": config.name,
            "token": lock.token,
            "t": time.monotonic(),
            "owned": owned,
            "ensure_raised": raised,
        },
        key=EVENTS,
    )


if __name__ == "__main__":
    run_client(ClientConfig.from_json(sys.argv[1]))
