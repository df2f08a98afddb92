"""Whether a lock's holder is shown dead: the rule an operator's release without ``force``
follows (``celery redlock release``, :func:`.admin.release`). Knows nothing of Celery.

An operator tool must never be what breaks a lock, so the rule asks for proof, never for a
likelihood. A holder may be released without ``force`` only when one of these is *seen*:

- **gone**: its record names this host, and the pid it names no longer runs here (or is a
  zombie waiting to be reaped);
- **stale**: no extension landed for longer than the heartbeat interval its record gives plus
  :func:`margin`, seen by watching: its key's PTTL read on every master over time, where an
  extension shows as the PTTL leaving its countdown (going up, or down to a shorter TTL). Only
  when a quorum of masters showed the key counting down undisturbed for that long is it stale:
  a successful extension lands on a quorum, and any quorum shares a master with that one;
- **expired**: its validity has run out anyway: a quorum of masters answered without its token
  (what is left on the others can hold nothing; deleting it breaks no lock). A token never seen
  on a quorum may be an acquisition still in flight, so for one of those the quorum without it
  must still be seen ``margin(0, request_timeout)`` (at least 0.5 s) after the first look, when
  any acquiring round that wrote it has ended (a round lasts at most its request_timeout).

Everything else is refused: **alive** (an extension was seen on any master), **queued** (a
queued message's marker: its run will take the key over), **unknown** (nothing above could be
seen within the watch). Unknown covers a record that gives no heartbeat interval (a holder
that runs without heartbeat, a script's own holder text, a record from before the field): its
PTTL says nothing about whether it still runs, so only its pid (on this host) or its expiry can
show it dead. Nothing is inferred from the TTL a record states: a holder may extend to another.

The watch lasts as long as the rule needs and ends at the first answer: at most the holder's
interval plus margin (or until its validity runs out, if sooner), at most ``watch`` seconds.
When even that cannot fit in ``watch``, it is refused at once, saying how long it would take.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Literal

from .clock import now
from .heartbeat import margin
from .holder import HolderRecord, process_identity
from .lockview import DEFAULT_TIMEOUT, LockView, _inspect
from .redlock import Redlock

# How long a watch may last at most by default: a heartbeat interval up to 40 s (a 120 s TTL's
# default) plus its margin fits.
DEFAULT_WATCH = 60.0
# How often the watch reads the key.
WATCH_POLL = 0.2
# A PTTL further than this from its countdown (beyond what the reads' own round trips allow)
# was set anew: an extension. Larger than the masters' 1 ms resolution and clock slew over a
# watch; a wrong "extended" only refuses.
EXTENSION_SLACK = 0.05

LivenessState = Literal["alive", "stale", "gone", "expired", "unknown", "queued"]
RELEASABLE: tuple[LivenessState, ...] = ("stale", "gone", "expired")


@dataclass(frozen=True)
class Liveness:
    """Whether a lock's holder is shown dead (see the module docstring): ``state``, ``reason``
    (what was seen) and ``watched`` (seconds spent watching)."""

    state: LivenessState
    reason: str
    watched: float = 0.0

    @property
    def releasable(self) -> bool:
        """Whether a release may go ahead without ``force``: shown dead, or expired."""
        return self.state in RELEASABLE


def pid_runs(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie does not: it holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it runs
    # A killed process its parent has not reaped yet (a zombie) still answers kill(pid, 0), but
    # holds nothing any more; /proc tells (Linux; elsewhere the watch decides).
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return True
    return state not in ([b"Z"], [b"X"])


def _checkable_pid(holder: HolderRecord | None) -> int | None:
    """The pid the record names, when its process can be checked from here: the record names
    this host and carries the process's identity, from this boot and this pid namespace (a pid
    of another container that shares the host name says nothing here). Else None."""
    if holder is None or holder.pid is None or holder.host != socket.gethostname() or not holder.proc:
        return None
    mine = process_identity()
    boot, namespace, _ = holder.proc.rsplit(":", 2) if holder.proc.count(":") >= 2 else ("", "", "")
    if mine is None or mine.rsplit(":", 1)[0] != f"{boot}:{namespace}":
        return None
    return holder.pid


def _pid_gone(holder: HolderRecord, pid: int) -> bool:
    """Whether the process the record names is gone: its pid runs no process, a zombie, or a
    later process that reused the pid (another start time)."""
    if not pid_runs(pid):
        return True
    now_there = process_identity(pid)
    return now_there is not None and now_there != holder.proc


@dataclass(frozen=True)
class _Read:
    """One read of the key on every master: when it was sent and answered (``now()``), each
    master's PTTL where it holds the token with one (else None), how many masters hold the token
    and how many answered without it."""

    sent: float
    received: float
    pttls: tuple[float | None, ...]
    holding: int
    without: int


def _read(redlock: Redlock, key: str, token: str, timeout: float) -> _Read:
    sent = now()
    masters = _inspect(redlock, [key.encode()], timeout)[0].masters
    received = now()
    pttls = tuple(m.pttl if m.holds(token) else None for m in masters)
    holding = sum(1 for m in masters if m.holds(token))
    without = sum(1 for m in masters if m.kind != "error" and not m.holds(token))
    return _Read(sent, received, pttls, holding, without)


@dataclass(frozen=True)
class _Base:
    """A master's first read holding the token: its PTTL, and when that read was sent and
    answered. The PTTL counts down from there, unless an extension sets it anew."""

    pttl: float
    sent: float
    received: float

    def extended(self, pttl: float, read: _Read) -> bool:
        # The master read the PTTL somewhere inside each round trip: between the two reads,
        # at least read.sent - self.received and at most read.received - self.sent passed.
        highest = self.pttl - (read.sent - self.received)
        lowest = self.pttl - (read.received - self.sent)
        return pttl > highest + EXTENSION_SLACK or pttl < lowest - EXTENSION_SLACK

    def quiet(self, read: _Read) -> float:
        """How long, at least, this master has held the token without an extension."""
        return read.sent - self.received


class _Watch:
    """The reads of one watch, master by master."""

    def __init__(self, redlock: Redlock, first: _Read, *, held: bool) -> None:
        self.names = [m.name for m in redlock.masters]
        self.quorum = redlock.quorum
        self.first = first
        # Seen on a quorum: a quorum without it since means it was released or expired. A token
        # only ever seen on fewer may be an acquisition in flight, whose round settles within
        # ``settle`` (a round takes at most its request_timeout): only a quorum without it
        # after that shows it gone.
        self.held = held or first.holding >= self.quorum
        self.settle = margin(0.0, redlock.request_timeout)
        self.bases: list[_Base | None] = [None] * len(first.pttls)
        self.add(first)

    def add(self, read: _Read) -> str | None:
        """Take ``read`` in; the name of a master it shows an extension on, if any."""
        self.held = self.held or read.holding >= self.quorum
        for i, pttl in enumerate(read.pttls):
            base = self.bases[i]
            if pttl is None:
                continue
            if base is None:
                self.bases[i] = _Base(pttl, read.sent, read.received)
            elif base.extended(pttl, read):
                return self.names[i]
        return None

    def expired(self, read: _Read) -> bool:
        """Whether ``read`` shows the token's validity run out: a quorum answered without it."""
        settled = self.held or read.sent - self.first.received >= self.settle
        return read.without >= self.quorum and settled

    def expires_in(self) -> float | None:
        """Seconds from the first read until it can show the token expired, if nothing extends
        it (None: cannot be known: masters not answering, or a key without TTL)."""
        read = self.first
        needed = self.quorum - read.without
        left = sorted(p for p in read.pttls if p is not None)
        if needed > len(left):
            return None
        expiry = 0.0 if needed <= 0 else left[needed - 1]
        return expiry if self.held else max(expiry, self.settle)

    def quiet(self, read: _Read) -> float:
        """How long a quorum of masters has been seen holding the token, unextended."""
        spans = sorted(
            (
                base.quiet(read)
                for base, pttl in zip(self.bases, read.pttls, strict=True)
                if base is not None and pttl is not None
            ),
            reverse=True,
        )
        return spans[self.quorum - 1] if len(spans) >= self.quorum else 0.0


def liveness(
    redlock: Redlock,
    view: LockView,
    *,
    watch: float = DEFAULT_WATCH,
    timeout: float = DEFAULT_TIMEOUT,
) -> Liveness:
    """Whether the holder of ``view`` (a :func:`.lockview.show` result) is shown dead, its
    validity has run out, or neither (see the module docstring). Watches at most ``watch``
    seconds, and returns as soon as the answer is known."""
    token, holder = view.token, view.holder
    if token is None:
        return _not_held(view)
    shown = _without_watching(view)
    if shown is not None:
        return shown
    first = _read(redlock, view.key, token, timeout)
    seen = _Watch(redlock, first, held=view.held)
    if seen.expired(first):
        return _expired(first, len(redlock.masters), 0.0)
    window = _stale_window(redlock, holder)
    expires = seen.expires_in()
    needed = _watch_needed(window, expires)
    if needed is None or needed > watch:
        return Liveness("unknown", _cannot_show(redlock, holder, watch, window, expires))
    return _watched(redlock, view.key, token, seen, window, watch, timeout)


def _not_held(view: LockView) -> Liveness:
    """A view no master holds a token in: expired, unless some master did not answer."""
    if any(m.kind == "error" for m in view.masters):
        return Liveness("unknown", "no master that answered holds a lock on it; some did not answer")
    return Liveness("expired", "no master holds a lock on it")


def _without_watching(view: LockView) -> Liveness | None:
    """What the holder record alone shows: a queued message's marker, or a holder whose
    process is gone from this host. None: only watching the key can tell."""
    holder = view.holder
    if holder is not None and holder.queued:
        return Liveness(
            # The state already says "queued": the description's own "queued: " is not repeated.
            "queued",
            f"{view.describe_holder().removeprefix('queued: ')}; a message still in the broker, "
            "whose run takes the key over",
        )
    pid = _checkable_pid(holder)
    if holder is not None and pid is not None and _pid_gone(holder, pid):
        return Liveness("gone", f"its holder's process (pid {pid}) no longer runs on this host")
    return None


def _stale_window(redlock: Redlock, holder: HolderRecord | None) -> float | None:
    """How long a quorum must be seen without an extension to show the holder stale: its
    heartbeat interval plus margin (None: its record gives no interval)."""
    interval = holder.heartbeat if holder is not None else None
    return None if interval is None else interval + margin(interval, redlock.request_timeout)


def _watch_needed(window: float | None, expires: float | None) -> float | None:
    """The shortest watch sure to reach an answer: the stale window, or until the validity can
    be seen run out (plus one poll), whichever is shorter. None: neither is known."""
    needed = [t for t in (window, None if expires is None else expires + WATCH_POLL) if t is not None]
    return min(needed) if needed else None


def _watched(
    redlock: Redlock, key: str, token: str, seen: _Watch, window: float | None, watch: float, timeout: float
) -> Liveness:
    """Read the key until the holder is seen extending it, is shown dead, or its validity runs
    out; at most ``watch`` seconds."""
    started = seen.first.sent
    while True:
        time.sleep(max(0.0, min(WATCH_POLL, watch - (now() - started))))
        read = _read(redlock, key, token, timeout)
        waited = read.received - started
        extended_on = seen.add(read)
        if seen.expired(read):
            return _expired(read, len(redlock.masters), waited)
        if extended_on is not None:
            return Liveness(
                "alive", f"its holder extended the lock ({extended_on}) {waited:.1f} s into the watch", waited
            )
        quiet = seen.quiet(read)
        if window is not None and quiet >= window:
            return Liveness(
                "stale",
                f"no extension on a quorum for {quiet:.1f} s, longer than its heartbeat interval "
                f"plus margin ({window:g} s)",
                waited,
            )
        if waited >= watch:
            return Liveness(
                "unknown",
                f"cannot show it dead within --watch {watch:g} s (no extension seen, validity "
                "left); use --force or wait",
                waited,
            )


def _expired(read: _Read, masters: int, waited: float) -> Liveness:
    return Liveness(
        "expired",
        f"its token is gone from a quorum ({read.without} of {masters} masters answered without "
        "it): released, or its validity ran out",
        waited,
    )


def _cannot_show(
    redlock: Redlock, holder: HolderRecord | None, watch: float, window: float | None, expires: float | None
) -> str:
    """Why nothing the rule accepts can be seen within ``watch``, and what would do."""
    left = "unknown" if expires is None else f"{expires:.1f} s"
    if window is not None and holder is not None and holder.heartbeat is not None:
        interval = holder.heartbeat
        why = (
            f"it needs {window:g} s of watching (heartbeat interval {interval:g} s + margin "
            f"{margin(interval, redlock.request_timeout):g} s)"
        )
        more = f"use --watch {math.ceil(window)}, --force, or wait"
    else:
        pid = _checkable_pid(holder)
        why = (
            "its holder text is not a record (no heartbeat interval, no pid)"
            if holder is None
            else "its record gives no heartbeat interval (it runs without heartbeat, or its "
            "writer did not record one)"
        )
        if holder is not None:
            why += (
                ", and its pid cannot be checked from this host"
                if pid is None
                else f", and its process (pid {pid}) still runs on this host"
            )
        wait = "wait" if expires is None else f"use --watch {math.ceil(expires + WATCH_POLL)} to wait for it"
        more = f"only its validity running out can show it dead; {wait}, or use --force"
    return f"cannot show it dead within --watch {watch:g} s: {why}; its validity left: {left}; {more}"
