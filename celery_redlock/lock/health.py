"""Whether the masters are fit to hold locks: ``celery redlock health`` (re-exported by
:mod:`.admin`, the operators' API). Knows nothing of Celery.

:func:`health` reports, per master, whether it is reachable, its round-trip time, version,
role, persistence, eviction policy, clock offset against the others, and whether our commands
and scripts run (ACL), with a :class:`Finding` for each thing wrong; :func:`round_trips` is the
round-trip time alone (the metrics' gauge).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .clock import now
from .commands import EXTEND, PLAIN
from .lockview import DEFAULT_TIMEOUT, _decode
from .redlock import Redlock
from .transport.commands import Command, Outcome

# A master's clock this far (seconds) from the others' median is reported: keys expire by the
# master's wall clock, and one that is this far off is probably not synchronized (and may step).
CLOCK_OFFSET_WARNING = 1.0
# The eviction policy that never drops a key: any other may drop a held lock (every lock key has
# a TTL, so volatile-* policies choose among them too).
SAFE_EVICTION = "noeviction"
# What the probe's SET NX PX, extend script and release script answer on a master that runs
# them as a lock does.
PROBE_ANSWERS = (b"OK", 1, 1)

Level = Literal["error", "warning", "note"]


@dataclass(frozen=True)
class Finding:
    level: Level
    what: str

    def __str__(self) -> str:
        return f"{self.level}: {self.what}"


@dataclass(frozen=True)
class MasterHealth:
    """One master's state. ``rtt`` and ``clock_offset`` (against the median of the others) are
    in seconds; fields a master would not tell are None."""

    master: str
    reachable: bool
    rtt: float | None = None
    server: str | None = None
    version: str | None = None
    role: str | None = None
    appendonly: bool | None = None
    appendfsync: str | None = None
    maxmemory_policy: str | None = None
    clock_offset: float | None = None
    commands_run: bool | None = None
    findings: tuple[Finding, ...] = ()

    @property
    def sound(self) -> bool:
        """Fit to vote: reachable, a master, and running our commands and scripts."""
        return not any(f.level == "error" for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["findings"] = [{"level": f.level, "what": f.what} for f in self.findings]
        data["sound"] = self.sound
        return data


@dataclass(frozen=True)
class Health:
    """The fleet's health. ``status``: ``ok`` (every master sound, nothing to warn of),
    ``degraded`` (a quorum is sound but some master has an error or a warning: fewer failures
    can be tolerated, or a lock may be dropped) or ``unsafe`` (fewer than a quorum are sound: no
    lock can be taken). ``exit_code`` is 0, 1, 3 for these: the operators' commands' exit
    statuses (see docs/cli.md; 2 is a usage error there)."""

    masters: tuple[MasterHealth, ...]
    quorum: int

    @property
    def sound(self) -> int:
        return sum(1 for m in self.masters if m.sound)

    @property
    def status(self) -> Literal["ok", "degraded", "unsafe"]:
        if self.sound < self.quorum:
            return "unsafe"
        if any(f.level in ("error", "warning") for m in self.masters for f in m.findings):
            return "degraded"
        return "ok"

    @property
    def exit_code(self) -> int:
        return {"ok": 0, "degraded": 1, "unsafe": 3}[self.status]

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "quorum": self.quorum,
            "sound": self.sound,
            "masters": [m.as_dict() for m in self.masters],
        }


def _info(reply: Any) -> dict[str, str]:
    fields = {}
    for line in _decode(reply).splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith("#"):
            fields[key.strip()] = value.strip()
    return fields


def _ok(outcome: Outcome) -> Any:
    if outcome.kind != "ok":
        return None
    return outcome.value


def health(redlock: Redlock, *, timeout: float = DEFAULT_TIMEOUT) -> Health:
    """Every master's state and the findings against it; see :class:`Health`.

    One round of INFO, CONFIG GET appendfsync and a probe on every master at once, then one
    TIME per master on its own (its round-trip time, and its clock read in the middle of it).
    The probe runs what a lock does on a throwaway key of its own
    (``<prefix>__health__:<random>``): ``SET NX PX``, the extend script and the release script,
    so a master that refuses writes (a replica, a full one) or our scripts (an ACL) shows.
    """
    names = [m.name for m in redlock.masters]
    probe_key = f"{redlock.key_prefix}__health__:{os.urandom(8).hex()}"
    probe_token = os.urandom(20).hex()
    # _master_health reads the replies by their place in this batch.
    batch: list[Command] = [
        ("INFO", "server"),
        ("INFO", "replication"),
        ("INFO", "persistence"),
        ("INFO", "memory"),
        ("CONFIG", "GET", "appendfsync"),
        ("SET", probe_key, probe_token, "NX", "PX", 10000),
        EXTEND.pack(probe_key, probe_token, 10000),
        PLAIN.release.pack(probe_key, probe_token),
    ]
    with redlock._round() as rnd:
        replies = rnd.call_many([batch] * len(names), timeout)
    times = _clocks(redlock, timeout)
    offsets = [t[2] - t[1] for t in times if t is not None]
    median = statistics.median(offsets) if offsets else 0.0
    result = []
    for i, name in enumerate(names):
        result.append(_master_health(name, replies[i], times[i], median, redlock.request_timeout, timeout))
    return Health(tuple(result), redlock.quorum)


def _clocks(redlock: Redlock, timeout: float) -> list[tuple[float, float, float] | None]:
    """Per master, (round-trip time, this host's clock halfway through it, the master's TIME),
    or None where it did not answer: one TIME per master, each in a call of its own (one
    round), so each master's round trip is its own."""
    names = redlock.masters
    times: list[tuple[float, float, float] | None] = []
    with redlock._round() as rnd:
        for i in range(len(names)):
            sent_wall, sent = time.time(), now()
            outcome = rnd.call([("TIME",) if j == i else None for j in range(len(names))], timeout)[i]
            rtt = now() - sent
            value = _ok(outcome)
            if isinstance(value, list) and len(value) == 2:
                times.append((rtt, sent_wall + rtt / 2, int(value[0]) + int(value[1]) / 1e6))
            else:
                times.append(None)
    return times


def round_trips(redlock: Redlock, *, timeout: float = DEFAULT_TIMEOUT) -> list[float | None]:
    """Each master's round-trip time for one TIME (seconds), None where it did not answer."""
    return [None if t is None else t[0] for t in _clocks(redlock, timeout)]


def _master_health(
    name: str,
    replies: Sequence[Outcome],
    timing: tuple[float, float, float] | None,
    median_offset: float,
    request_timeout: float,
    timeout: float = DEFAULT_TIMEOUT,
) -> MasterHealth:
    """One master's state from its replies to :func:`health`'s batch (in the batch's order)
    and its TIME (see :func:`_clocks`), with the findings against it, in the order of the
    checks below."""
    server_info = _ok(replies[0])
    if server_info is None or timing is None:
        return _unreachable(name, replies[0] if server_info is None else None, timeout)
    server = _info(server_info)
    kind = server.get("server_name", "redis")
    role = _section(replies[1]).get("role")
    appendonly = _appendonly(_section(replies[2]))
    policy = _section(replies[3]).get("maxmemory_policy")
    appendfsync = _appendfsync(_ok(replies[4]))
    refusal = _probe_refusal(replies[5:8])
    rtt, halfway, server_time = timing
    offset = server_time - halfway - median_offset
    checks = (
        _role_finding(role),
        _probe_finding(refusal),
        _persistence_finding(appendonly, appendfsync),
        _eviction_finding(policy),
        _clock_finding(offset),
        _round_trip_finding(rtt, request_timeout),
    )
    return MasterHealth(
        name,
        True,
        rtt=rtt,
        server=kind,
        version=server.get(f"{kind}_version") or server.get("redis_version"),
        role=role,
        appendonly=appendonly,
        appendfsync=appendfsync,
        maxmemory_policy=policy,
        clock_offset=offset,
        commands_run=refusal is None,
        findings=tuple(finding for finding in checks if finding is not None),
    )


def _unreachable(name: str, outcome: Outcome | None, timeout: float) -> MasterHealth:
    """A master that did not answer INFO (``outcome``), or did but not TIME (None). A reply
    that did not come says how long this check waited for it (``timeout``), not the lock's
    request_timeout: that is what the operator chose and saw pass."""
    if outcome is None:
        why = f"TIME not answered within {timeout:g} s"
    elif outcome.kind == "timeout":
        why = f"no reply within {timeout:g} s"
    else:
        why = outcome.detail or outcome.kind
    return MasterHealth(name, False, findings=(Finding("error", f"unreachable: {why}"),))


def _section(outcome: Outcome) -> dict[str, str]:
    """The fields of an INFO section; none when the master did not answer it."""
    return _info(_ok(outcome) or b"")


def _appendonly(persistence: dict[str, str]) -> bool | None:
    aof = persistence.get("aof_enabled")
    return None if aof is None else aof == "1"


def _appendfsync(reply: Any) -> str | None:
    """The value of a ``CONFIG GET appendfsync`` reply; None when refused."""
    return _decode(reply[1]) if isinstance(reply, list) and len(reply) == 2 else None


def _probe_refusal(probe: Sequence[Outcome]) -> Outcome | None:
    """The first of the probe's replies that is not what a lock's command gets, if any."""
    for outcome, expected in zip(probe, PROBE_ANSWERS, strict=True):
        if not (outcome.kind == "ok" and outcome.value == expected):
            return outcome
    return None


# -- the checks: each a finding, or None when there is nothing to say -----------------------------
def _role_finding(role: str | None) -> Finding | None:
    if role is not None and role != "master":
        return Finding(
            "error",
            f"role is {role}: a replica refuses the lock's writes, and a master that replicates "
            "another is not independent of it",
        )
    return None


def _probe_finding(refusal: Outcome | None) -> Finding | None:
    if refusal is not None:
        return Finding(
            "error", f"refuses the lock's commands or scripts: {refusal.detail or refusal.value!r}"
        )
    return None


def _persistence_finding(appendonly: bool | None, appendfsync: str | None) -> Finding | None:
    """A master that may lose its locks on a restart or a crash, and what to do about it."""
    if appendonly is False:
        return Finding(
            "note",
            "appendonly no: a restart loses its locks; restart it only after the largest lock "
            "TTL has passed (delayed restart)",
        )
    if appendonly and appendfsync is not None and appendfsync != "always":
        return Finding(
            "note",
            f"appendfsync {appendfsync}: a crash may lose the last writes; restart it only after "
            "the largest lock TTL, or set appendfsync always",
        )
    if appendonly and appendfsync is None:
        return Finding("note", "appendfsync unknown (CONFIG GET refused)")
    return None


def _eviction_finding(policy: str | None) -> Finding | None:
    if policy is not None and policy != SAFE_EVICTION:
        return Finding(
            "warning",
            f"maxmemory-policy {policy}: under memory pressure it may evict a held lock; use {SAFE_EVICTION}",
        )
    return None


def _clock_finding(offset: float) -> Finding | None:
    if abs(offset) > CLOCK_OFFSET_WARNING:
        return Finding(
            "warning",
            f"clock {offset:+.3f} s from the others' median: keys expire by the master's "
            "clock, and one this far off is probably not synchronized",
        )
    return None


def _round_trip_finding(rtt: float, request_timeout: float) -> Finding | None:
    if rtt > request_timeout / 2:
        return Finding(
            "warning",
            f"round trip {rtt * 1000:.1f} ms is more than half of request_timeout "
            f"({request_timeout * 1000:g} ms)",
        )
    return None
