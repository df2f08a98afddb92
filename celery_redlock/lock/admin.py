"""Operators' tools over a Redlock's masters: which locks are held and by whom, a stuck lock
freed by hand, and whether the masters are fit to hold locks. Knows nothing of Celery.

The ``celery redlock`` command prints what these return; an admin page can call them as they
are (``Redlock`` in, plain frozen dataclasses out):

- :func:`list_locks` (``ls``): every lock a quorum holds, found by a bounded ``SCAN`` (never
  ``KEYS``), each read on every master in one atomic look (the ``INSPECT`` script);
- :func:`show` (``show``): one lock's per-master view (token, holder, PTTL), and whether a
  quorum holds it;
- :func:`liveness` and :func:`force_release` (``release``): whether the holder still extends
  the lock, and the compare-and-delete of exactly the token that was shown;
- :func:`health` (``health``): per master, reachable, round-trip time, version, role,
  persistence, eviction policy, clock offset against the others, and whether our commands and
  scripts run (ACL).

Every operation goes through the Redlock's own rounds (:class:`~.masters.Round`): one command
per master in parallel, by one deadline, so a dead master costs ``timeout`` once, never a hang.

The holder text (``Redlock.lock(holder=...)``) is stored as given. When it is a JSON object it
is read for the keys ``task`` (an id), ``name`` (what runs: a task name), ``host``, ``pid``,
``since`` (epoch seconds) and ``ttl`` (seconds): the record the Celery layer writes. Any other
text is shown as it is.

**Alive or not** (see :func:`liveness`): the masters cannot see a process, only what it does to
its key. A holder that keeps its lock alive resets the key's PTTL to its TTL at least every
``ttl / 3`` (the heartbeat's interval). So a lock whose PTTL was not reset for half its TTL
(:data:`STALE_FRACTION`) has a holder that stopped extending it: it is *stale*. The check reads
the PTTL, then watches it until either it goes up on a quorum (an extension landed: *alive*) or
the lock has gone unextended for half its TTL (*stale*), at most ``watch`` seconds (then
*unknown*). A holder recorded on this very host whose pid no longer runs is *gone* without
watching. Only *stale* and *gone* may be released without ``force``. A holder that never
extends (no heartbeat, or no TTL in its record) cannot be told alive from dead by the masters:
it reads as *unknown*, and only ``force`` releases it.
"""

from __future__ import annotations

import dataclasses
import getpass
import logging
import os
import socket
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError, RedlockError
from . import scripts
from .clock import now
from .commands import EXTEND, PLAIN, REENTRANT
from .holder import Holder
from .masters import Command, Outcome, script_template
from .redlock import Redlock
from .resource import HOLDER_SEPARATOR, QUEUE_SUFFIX, RESERVED_SUFFIXES, lock_key

logger = logging.getLogger("celery_redlock.admin")

# Each SCAN asks a master for this many keys; a listing stops after MAX_SCAN_STEPS of them per
# master (about a million keys looked at) or ``limit`` locks found, whichever comes first.
SCAN_COUNT = 1000
MAX_SCAN_STEPS = 1000
# Keys read per round by INSPECT (one pipelined write per master).
INSPECT_BATCH = 500
# The default per-round timeout of these tools: they run off the lock path, on an operator's
# command, and INFO or a SCAN step may take longer than a lock command's request_timeout.
DEFAULT_TIMEOUT = 1.0
# A lock unextended for this fraction of its TTL is stale: the heartbeat extends every ttl / 3.
STALE_FRACTION = 0.5
# How long liveness() watches a key at most, by default; and how often it looks.
DEFAULT_WATCH = 30.0
WATCH_POLL = 0.2
# A PTTL that came back more than this above what counting down would have left was reset.
EXTENSION_SLACK = 0.05
# A master's clock this far (seconds) from the others' median is reported: keys expire by the
# master's wall clock, and one that is this far off is probably not synchronized (and may step).
CLOCK_OFFSET_WARNING = 1.0
# The eviction policy that never drops a key: any other may drop a held lock (every lock key has
# a TTL, so volatile-* policies choose among them too).
SAFE_EVICTION = "noeviction"
# The fair lock's waiting room and its deadlines sit beside the lock key (see scripts.py).
SIBLING_SUFFIXES = RESERVED_SUFFIXES  # fair queues and fence counters: not locks
SIBLING_SUFFIXES_BYTES = tuple(s.encode() for s in SIBLING_SUFFIXES)
TOKEN_HEX = 40

_INSPECT = script_template(scripts.INSPECT, 2, 0)  # key, queue key


class ReleaseRefused(RedlockError):
    """A force-release that was not done: the holder is alive, or the lock is no longer held by
    the token that was shown. The message says which, and what to do."""


# -- what a lock key holds ----------------------------------------------------------------------
LockKind = Literal["free", "plain", "reentrant", "other", "error"]


@dataclass(frozen=True)
class MasterView:
    """What one master holds under one lock key.

    ``kind``: ``free`` (no key), ``plain`` (a token string), ``reentrant`` (a hash of tokens),
    ``other`` (a key that is not a lock), ``error`` (no answer; ``error`` says why). ``tokens``
    are the whole stored tokens (random part, separator, holder), with their counts for a
    reentrant lock (1 for a plain one); ``pttl`` is in seconds (None: no key, or no TTL).
    """

    master: str
    kind: LockKind
    tokens: tuple[tuple[str, int], ...] = ()
    pttl: float | None = None
    queued: int = 0
    error: str = ""

    def holds(self, token: str) -> bool:
        return any(t == token for t, _ in self.tokens)

    def as_dict(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "kind": self.kind,
            "tokens": [{"token": t, "count": c, "holder": _holder_text(t)} for t, c in self.tokens],
            "pttl": self.pttl,
            "queued": self.queued,
            "error": self.error,
        }


@dataclass(frozen=True)
class LockView:
    """One lock as every master holds it, read at ``read_at`` (epoch seconds).

    ``token`` is the token most masters hold, ``agree`` how many hold it; the lock is held iff
    ``agree >= quorum``. ``ttl_left`` is how long a quorum still holds it (the quorum-th longest
    PTTL among those masters), ``queued`` the most waiters any master has in its fair queue.
    """

    name: str
    key: str
    kind: LockKind
    token: str | None
    agree: int
    quorum: int
    holder: Holder | None
    ttl_left: float | None
    queued: int
    masters: tuple[MasterView, ...]
    read_at: float

    @property
    def held(self) -> bool:
        return self.token is not None and self.agree >= self.quorum

    @property
    def age(self) -> float | None:
        return None if self.holder is None else self.holder.age(self.read_at)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "kind": self.kind,
            "held": self.held,
            "token": self.token,
            "agree": self.agree,
            "quorum": self.quorum,
            "holder": None if self.holder is None else self.holder.as_dict(),
            "holder_text": None if self.holder is None else self.holder.describe(self.read_at),
            "age": self.age,
            "ttl_left": self.ttl_left,
            "queued": self.queued,
            "masters": [m.as_dict() for m in self.masters],
            "read_at": self.read_at,
        }


def _holder_text(token: str) -> str:
    return token.partition(HOLDER_SEPARATOR)[2]


def _is_token(text: str) -> bool:
    random_part = text[:TOKEN_HEX]
    return (
        len(random_part) == TOKEN_HEX
        and all(c in "0123456789abcdef" for c in random_part)
        and (len(text) == TOKEN_HEX or text[TOKEN_HEX] == HOLDER_SEPARATOR)
    )


def _decode(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _master_view(master: str, outcome: Outcome) -> MasterView:
    """One master's INSPECT reply as a view."""
    if outcome.kind != "ok":
        return MasterView(master, "error", error=outcome.detail or outcome.kind)
    reply = outcome.value
    if not isinstance(reply, list) or len(reply) < 3:
        return MasterView(master, "error", error=f"unexpected reply {reply!r}")
    kind, pttl, queued, rest = _decode(reply[0]), reply[1], int(reply[2]), reply[3:]
    seconds = pttl / 1000 if isinstance(pttl, int) and pttl >= 0 else None
    if kind == "none":
        return MasterView(master, "free", queued=queued)
    if kind == "string" and rest and _is_token(_decode(rest[0])):
        return MasterView(master, "plain", ((_decode(rest[0]), 1),), seconds, queued)
    if kind == "hash" and rest:
        tokens = []
        for field, count in zip(rest[::2], rest[1::2], strict=False):
            text = _decode(field)
            if not _is_token(text):
                return MasterView(master, "other", pttl=seconds, queued=queued)
            try:
                tokens.append((text, int(count)))
            except ValueError:
                return MasterView(master, "other", pttl=seconds, queued=queued)
        return MasterView(master, "reentrant", tuple(tokens), seconds, queued)
    return MasterView(master, "other", pttl=seconds, queued=queued)


def _lock_view(redlock: Redlock, key: str, views: Sequence[MasterView], read_at: float) -> LockView:
    counts: dict[str, int] = {}
    for view in views:
        for held, _ in view.tokens:
            counts[held] = counts.get(held, 0) + 1
    token = max(counts, key=lambda t: counts[t]) if counts else None
    agree = counts[token] if token is not None else 0
    kinds = {v.kind for v in views if v.kind in ("plain", "reentrant")}
    kind: LockKind
    if len(kinds) == 1:
        kind = kinds.pop()
    elif kinds:
        kind = "other"  # both forms on different masters: a name used both ways
    elif any(v.kind == "other" for v in views):
        kind = "other"
    elif all(v.kind == "error" for v in views):
        kind = "error"
    else:
        kind = "free"
    ttl_left = None
    if token is not None:
        left = sorted(
            (v.pttl for v in views if v.holds(token) and v.pttl is not None),
            reverse=True,
        )
        if len(left) >= redlock.quorum:
            ttl_left = left[redlock.quorum - 1]
    prefix = redlock.key_prefix
    return LockView(
        name=key[len(prefix) :] if key.startswith(prefix) else key,
        key=key,
        kind=kind,
        token=token,
        agree=agree,
        quorum=redlock.quorum,
        holder=None if token is None else Holder.parse(_holder_text(token)),
        ttl_left=ttl_left,
        queued=max((v.queued for v in views), default=0),
        masters=tuple(views),
        read_at=read_at,
    )


def _inspect(redlock: Redlock, keys: Sequence[bytes], timeout: float) -> list[LockView]:
    """Every key of ``keys`` read on every master, INSPECT_BATCH keys per round."""
    found = []
    names = [m.name for m in redlock.masters]
    for start in range(0, len(keys), INSPECT_BATCH):
        chunk = keys[start : start + INSPECT_BATCH]
        batch = [_INSPECT.pack(key, key + QUEUE_SUFFIX.encode()) for key in chunk]
        read_at = time.time()
        with redlock._round() as rnd:
            replies = rnd.call_many([batch] * len(names), timeout)
        for j, key in enumerate(chunk):
            views = [_master_view(names[i], replies[i][j]) for i in range(len(names))]
            found.append(_lock_view(redlock, key.decode("utf-8", "replace"), views, read_at))
    return found


def show(redlock: Redlock, name: str, *, timeout: float = DEFAULT_TIMEOUT) -> LockView:
    """The lock on resource ``name`` as every master holds it (one round)."""
    return _inspect(redlock, [lock_key(redlock.key_prefix, name).encode()], timeout)[0]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@dataclass(frozen=True)
class Listing:
    """What :func:`list_locks` found: ``locks`` held on a quorum (or on any master, with
    ``partial=True``), by name; ``complete`` is False when the scan stopped at its bound or a
    master did not answer it (``errors``: master -> why)."""

    locks: tuple[LockView, ...]
    complete: bool
    errors: dict[str, str]


def list_locks(
    redlock: Redlock,
    pattern: str = "*",
    *,
    limit: int = 1000,
    partial: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> Listing:
    """The locks on resources whose name matches the glob ``pattern``, held on a quorum.

    Found with ``SCAN ... MATCH <prefix><pattern>`` on every master in parallel (never
    ``KEYS``), stopping after ``limit`` candidate keys or MAX_SCAN_STEPS steps per master; then
    each candidate is read on every master (:func:`show`'s look, pipelined). Keys that are not
    locks (a beat leader record, a fair lock's queue) are left out.
    """
    if limit < 1:
        raise ConfigError(f"limit must be at least 1, got {limit!r}")
    match = _glob_escape(redlock.key_prefix) + pattern
    names = [m.name for m in redlock.masters]
    cursors: list[bytes | None] = [b"0"] * len(names)  # None: that master's scan is done
    errors: dict[str, str] = {}
    candidates: dict[bytes, None] = {}
    steps = 0
    with redlock._round() as rnd:
        while any(c is not None for c in cursors) and len(candidates) < limit and steps < MAX_SCAN_STEPS:
            steps += 1
            commands = [
                None if cursor is None else ("SCAN", cursor, "MATCH", match, "COUNT", SCAN_COUNT)
                for cursor in cursors
            ]
            outcomes = rnd.call(commands, timeout)
            for i, outcome in enumerate(outcomes):
                if cursors[i] is None:
                    continue
                reply = outcome.value
                if outcome.kind != "ok" or not isinstance(reply, list) or len(reply) != 2:
                    errors[names[i]] = outcome.detail or outcome.kind
                    cursors[i] = None
                    continue
                for key in reply[1]:
                    if not key.endswith(SIBLING_SUFFIXES_BYTES):
                        candidates[key] = None
                cursors[i] = None if reply[0] == b"0" else reply[0]
    complete = not errors and all(c is None for c in cursors)
    keys = sorted(candidates)[:limit]
    views = [
        view
        for view in _inspect(redlock, keys, timeout)
        if view.kind in ("plain", "reentrant", "other") and view.token is not None and (partial or view.held)
    ]
    return Listing(tuple(views), complete and len(candidates) <= limit, errors)


# -- alive or not, and force-release --------------------------------------------------------------
LivenessState = Literal["alive", "stale", "gone", "unknown", "released"]


@dataclass(frozen=True)
class Liveness:
    """Whether a lock's holder still keeps it alive (see the module docstring).

    ``state``: ``alive`` (its PTTL was reset while watched), ``stale`` (not extended for
    STALE_FRACTION of its TTL), ``gone`` (the holder's pid no longer runs on this host),
    ``unknown`` (neither could be seen within the watch), ``released`` (the token shown no
    longer holds a quorum: released, expired or taken over). ``reason`` says what was seen.
    """

    state: LivenessState
    reason: str
    watched: float = 0.0

    @property
    def releasable(self) -> bool:
        """Whether a force-release may go ahead without ``force``."""
        return self.state in ("stale", "gone")


def _pid_runs(pid: int) -> bool:
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


def _pttls(redlock: Redlock, key: str, token: str, timeout: float) -> list[float | None]:
    """Each master's PTTL (seconds) of ``key`` while it holds ``token``, else None."""
    views = _inspect(redlock, [key.encode()], timeout)[0].masters
    return [v.pttl if v.holds(token) else None for v in views]


def liveness(
    redlock: Redlock,
    view: LockView,
    *,
    watch: float = DEFAULT_WATCH,
    timeout: float = DEFAULT_TIMEOUT,
) -> Liveness:
    """Whether the holder of ``view`` (a :func:`show` result) still keeps its lock alive.

    Watches for at most ``watch`` seconds, returning as soon as the answer is known (see the
    module docstring for the rule).
    """
    if not view.held or view.token is None:
        return Liveness("released", "no quorum of masters holds a lock on it")
    token, holder = view.token, view.holder
    here = holder is not None and holder.pid is not None and holder.host == socket.gethostname()
    if here and holder is not None and holder.pid is not None and not _pid_runs(holder.pid):
        return Liveness("gone", f"its holder's process (pid {holder.pid}) no longer runs on this host")
    ttl = holder.ttl if holder is not None else None
    started = now()
    first = [v.pttl if v.holds(token) else None for v in view.masters]
    # Seen reset on a quorum: a PTTL above what counting down from the first look leaves.
    while True:
        waited = now() - started
        current = _pttls(redlock, view.key, token, timeout)
        if sum(1 for p in current if p is not None) < redlock.quorum:
            return Liveness("released", "the token shown no longer holds a quorum", waited)
        reset = sum(
            1
            for before, after in zip(first, current, strict=True)
            if before is not None and after is not None and after > before - waited + EXTENSION_SLACK
        )
        if reset >= redlock.quorum:
            return Liveness("alive", f"its holder extended the lock {waited:.1f} s into the watch", waited)
        if ttl is not None:
            # The quorum-th freshest key: how long since a quorum last saw an extension.
            left = sorted((p for p in current if p is not None), reverse=True)[redlock.quorum - 1]
            unextended = ttl - left
            if unextended >= STALE_FRACTION * ttl:
                return Liveness(
                    "stale",
                    f"not extended for {unextended:.1f} s of its {ttl:g} s TTL (a live holder "
                    f"extends every {ttl / 3:.1f} s)",
                    waited,
                )
        if waited >= watch:
            why = (
                "its record gives no TTL, so a holder that does not extend cannot be told from a dead one"
                if ttl is None
                else f"the watch of {watch:g} s ended first"
            )
            return Liveness("unknown", f"no extension seen in {waited:.1f} s; {why}", waited)
        time.sleep(min(WATCH_POLL, max(0.0, watch - waited)))


@dataclass(frozen=True)
class Released:
    """A force-release: how many masters deleted the token (``deleted``), of ``masters``."""

    name: str
    token: str
    deleted: int
    masters: int
    by: str


def operator_identity() -> str:
    """``user@host pid N``: who ran a force-release, for the log line it leaves."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without passwd entry)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def force_release(
    redlock: Redlock,
    view: LockView,
    *,
    token: str | None = None,
    by: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Released:
    """Delete ``view``'s lock on every master that still holds exactly its token (or ``token``),
    compare-and-delete, so a lock taken since by someone else is left alone. Waiters are woken
    as by a release. Logged at WARNING with ``by`` (default :func:`operator_identity`).

    Does not check liveness: :func:`release` does, or call :func:`liveness` first.
    """
    token = token if token is not None else view.token
    if token is None:
        raise ReleaseRefused(f"lock {view.name!r} has no token to release: no master holds it")
    commands = REENTRANT if view.kind == "reentrant" else PLAIN
    command = commands.release.pack(view.key, token)
    with redlock._round() as rnd:
        outcomes = rnd.call([command] * len(redlock.masters), timeout)
    deleted = sum(1 for o in outcomes if o.kind == "ok" and o.value == 1)
    by = by or operator_identity()
    holder = view.holder.describe(view.read_at) if view.holder is not None else "?"
    logger.warning(
        "force-released %s (token %s..., held by %s) on %d of %d masters, by %s",
        view.key,
        token[:12],
        holder,
        deleted,
        len(outcomes),
        by,
    )
    return Released(view.name, token, deleted, len(outcomes), by)


def release(
    redlock: Redlock,
    name: str,
    *,
    token: str | None = None,
    force: bool = False,
    watch: float = DEFAULT_WATCH,
    by: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[Released, Liveness | None]:
    """Force-release the lock on resource ``name``: :func:`show`, then unless ``force``
    :func:`liveness` (refused with :class:`ReleaseRefused` unless the holder is stale or gone),
    then :func:`force_release` of the token shown. ``token``, if given, must be the one a
    quorum holds (what an operator was shown earlier), else the release is refused."""
    view = show(redlock, name, timeout=timeout)
    if token is not None and view.token != token:
        raise ReleaseRefused(
            f"lock {name!r} is no longer held by the token shown ({token[:12]}...): "
            f"now {'free' if view.token is None else view.token[:12] + '...'}; show it again"
        )
    if not view.held and not force:
        raise ReleaseRefused(
            f"lock {name!r} is not held on a quorum ({view.agree} of {len(view.masters)} masters "
            "hold one token); --force removes what is left of it"
        )
    alive = None
    if not force:
        alive = liveness(redlock, view, watch=watch, timeout=timeout)
        if not alive.releasable:
            raise ReleaseRefused(f"lock {name!r} not released: its holder is {alive.state}: {alive.reason}")
    return force_release(redlock, view, by=by, timeout=timeout), alive


# -- health ----------------------------------------------------------------------------------------
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
    lock can be taken). ``exit_code`` is 0, 1, 2 for these."""

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
        return {"ok": 0, "degraded": 1, "unsafe": 2}[self.status]

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
        result.append(_master_health(name, replies[i], times[i], median, redlock.request_timeout))
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
) -> MasterHealth:
    server_info = _ok(replies[0])
    if server_info is None or timing is None:
        outcome = replies[0] if server_info is None else None
        why = outcome.detail or outcome.kind if outcome is not None else "TIME not answered"
        return MasterHealth(name, False, findings=(Finding("error", f"unreachable: {why}"),))
    findings: list[Finding] = []
    server = _info(server_info)
    replication = _info(_ok(replies[1]) or b"")
    persistence = _info(_ok(replies[2]) or b"")
    memory = _info(_ok(replies[3]) or b"")
    fsync_reply = _ok(replies[4])
    appendfsync = _decode(fsync_reply[1]) if isinstance(fsync_reply, list) and len(fsync_reply) == 2 else None
    rtt, _, server_time = timing
    offset = server_time - timing[1] - median_offset
    kind = server.get("server_name", "redis")
    version = server.get(f"{kind}_version") or server.get("redis_version")
    role = replication.get("role")
    if role is not None and role != "master":
        findings.append(
            Finding(
                "error",
                f"role is {role}: a replica refuses the lock's writes, and a master that replicates "
                "another is not independent of it",
            )
        )
    probe = [replies[5], replies[6], replies[7]]
    expected = (b"OK", 1, 1)
    failures = [o for o, e in zip(probe, expected, strict=True) if not (o.kind == "ok" and o.value == e)]
    commands_run = not failures
    if failures:
        failed = failures[0]
        findings.append(
            Finding("error", f"refuses the lock's commands or scripts: {failed.detail or failed.value!r}")
        )
    aof = persistence.get("aof_enabled")
    appendonly = None if aof is None else aof == "1"
    if appendonly is False:
        findings.append(
            Finding(
                "note",
                "appendonly no: a restart loses its locks; restart it only after the largest lock "
                "TTL has passed (delayed restart)",
            )
        )
    elif appendonly and appendfsync is not None and appendfsync != "always":
        findings.append(
            Finding(
                "note",
                f"appendfsync {appendfsync}: a crash may lose the last writes; restart it only after "
                "the largest lock TTL, or set appendfsync always",
            )
        )
    elif appendonly and appendfsync is None:
        findings.append(Finding("note", "appendfsync unknown (CONFIG GET refused)"))
    policy = memory.get("maxmemory_policy")
    if policy is not None and policy != SAFE_EVICTION:
        findings.append(
            Finding(
                "warning",
                f"maxmemory-policy {policy}: under memory pressure it may evict a held lock; "
                f"use {SAFE_EVICTION}",
            )
        )
    if abs(offset) > CLOCK_OFFSET_WARNING:
        findings.append(
            Finding(
                "warning",
                f"clock {offset:+.3f} s from the others' median: keys expire by the master's "
                "clock, and one this far off is probably not synchronized",
            )
        )
    if rtt > request_timeout / 2:
        findings.append(
            Finding(
                "warning",
                f"round trip {rtt * 1000:.1f} ms is more than half of request_timeout "
                f"({request_timeout * 1000:g} ms)",
            )
        )
    return MasterHealth(
        name,
        True,
        rtt=rtt,
        server=kind,
        version=version,
        role=role,
        appendonly=appendonly,
        appendfsync=appendfsync,
        maxmemory_policy=policy,
        clock_offset=offset,
        commands_run=commands_run,
        findings=tuple(findings),
    )
