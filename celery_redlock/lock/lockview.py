"""What a lock key holds on every master, as operators see it: ``celery redlock show`` and
``ls`` (the functions are re-exported by :mod:`.admin`, the operators' API). Knows nothing of
Celery.

- :func:`show`: one lock's per-master view (token, holder, PTTL), and whether a quorum holds it;
- :func:`list_locks`: every lock a quorum holds, found by a bounded ``SCAN`` (never ``KEYS``),
  each read on every master in one atomic look (the ``INSPECT`` script).

The holder text (``Redlock.lock(holder=...)``) is stored as given. When it is a holder record
(:mod:`.holder`: the Celery layer's JSON, naming the task id, the task, host, pid, since, TTL)
it is read as one: ``LockView.holder``; and a record flagged ``queued`` is a *marker*, the lock
taken for a message still waiting in the broker, not a running holder. Any other text is shown
as it is (``LockView.holder_text``). A marker waiting beside a lock key held by someone else
(see :mod:`.markers`) is listed under its own key, ``<resource>~enqueued:<task>``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError
from .holder import INSPECT, HolderRecord, describe_holder, parse
from .redlock import Redlock
from .resource import HOLDER_SEPARATOR, QUEUE_SUFFIX, RESERVED_SUFFIXES, lock_key
from .transport.commands import Command, Outcome

# Each SCAN asks a master for this many keys; a listing stops after MAX_SCAN_STEPS of them per
# master (about a million keys looked at) or ``limit`` locks found, whichever comes first.
SCAN_COUNT = 1000
MAX_SCAN_STEPS = 1000
# Keys read per round by INSPECT (one pipelined write per master).
INSPECT_BATCH = 500
# The default per-round timeout of these tools: they run off the lock path, on an operator's
# command, and INFO or a SCAN step may take longer than a lock command's request_timeout.
DEFAULT_TIMEOUT = 1.0
# The fair lock's waiting room and its deadlines sit beside the lock key (see scripts.py).
SIBLING_SUFFIXES = RESERVED_SUFFIXES  # fair queues and fence counters: not locks
SIBLING_SUFFIXES_BYTES = tuple(s.encode() for s in SIBLING_SUFFIXES)
TOKEN_HEX = 40


# -- what a lock key holds ----------------------------------------------------------------------
LockKind = Literal["free", "plain", "reentrant", "other", "error"]
# A master's tokens under one key, each with its count (1 for a plain lock's).
_Tokens = tuple[tuple[str, int], ...]


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
    ``holder`` is the token's holder record, when its holder text is one (``holder_text``).
    """

    name: str
    key: str
    kind: LockKind
    token: str | None
    agree: int
    quorum: int
    holder: HolderRecord | None
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

    @property
    def holder_text(self) -> str | None:
        """The holder text stored with the token, as it was given."""
        return None if self.token is None else _holder_text(self.token)

    @property
    def marker(self) -> bool:
        """Whether the token is a queued message's marker (its holder has not started)."""
        return self.holder is not None and self.holder.queued

    def describe_holder(self) -> str:
        """Who holds it, in words (a marker's says ``queued:`` and its task id)."""
        return describe_holder(self.holder_text, self.read_at)

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
            "holder_text": None if self.token is None else self.describe_holder(),
            "marker": self.marker,
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
    held = _held_tokens(kind, rest)
    if held is None:
        return MasterView(master, "other", pttl=seconds, queued=queued)
    lock_kind, tokens = held
    return MasterView(master, lock_kind, tokens, seconds, queued)


def _held_tokens(kind: str, value: Sequence[Any]) -> tuple[LockKind, _Tokens] | None:
    """Which lock a key of Redis type ``kind`` whose value is ``value`` (INSPECT's reply after
    the PTTL and the queue length) is, and its tokens; None: the key is no lock."""
    if kind == "string" and value and _is_token(_decode(value[0])):
        return "plain", ((_decode(value[0]), 1),)
    if kind == "hash" and value:
        tokens = _reentrant_tokens(value)
        return None if tokens is None else ("reentrant", tokens)
    return None


def _reentrant_tokens(value: Sequence[Any]) -> _Tokens | None:
    """A hash's fields and values as a reentrant lock's tokens and their counts; None: a field
    that is not a token, or a count that is not a number, makes it no lock's hash."""
    tokens = []
    for field, count in zip(value[::2], value[1::2], strict=False):
        text = _decode(field)
        if not _is_token(text):
            return None
        try:
            tokens.append((text, int(count)))
        except ValueError:
            return None
    return tuple(tokens)


def _lock_view(redlock: Redlock, key: str, views: Sequence[MasterView], read_at: float) -> LockView:
    """The lock under ``key``, from every master's view of it."""
    token, agree = _most_held(views)
    prefix = redlock.key_prefix
    return LockView(
        name=key[len(prefix) :] if key.startswith(prefix) else key,
        key=key,
        kind=_lock_kind(views),
        token=token,
        agree=agree,
        quorum=redlock.quorum,
        holder=None if token is None else parse(_holder_text(token)),
        ttl_left=None if token is None else _ttl_left(views, token, redlock.quorum),
        queued=max((v.queued for v in views), default=0),
        masters=tuple(views),
        read_at=read_at,
    )


def _most_held(views: Sequence[MasterView]) -> tuple[str | None, int]:
    """The token most masters hold (of equals, the first seen), and how many hold it."""
    counts: dict[str, int] = {}
    for view in views:
        for held, _ in view.tokens:
            counts[held] = counts.get(held, 0) + 1
    if not counts:
        return None, 0
    token = max(counts, key=lambda t: counts[t])
    return token, counts[token]


def _lock_kind(views: Sequence[MasterView]) -> LockKind:
    """The kind of lock the masters hold: the one they agree on; ``other`` when a key is no
    lock; else ``error`` when none answered, ``free`` when none holds it."""
    kinds = {v.kind for v in views if v.kind in ("plain", "reentrant")}
    if len(kinds) == 1:
        return kinds.pop()
    if kinds:
        return "other"  # both forms on different masters: a name used both ways
    if any(v.kind == "other" for v in views):
        return "other"
    if all(v.kind == "error" for v in views):
        return "error"
    return "free"


def _ttl_left(views: Sequence[MasterView], token: str, quorum: int) -> float | None:
    """How long a quorum still holds ``token``: the quorum-th longest PTTL among the masters
    that hold it (None: fewer than a quorum hold it with a TTL)."""
    left = sorted((v.pttl for v in views if v.holds(token) and v.pttl is not None), reverse=True)
    return left[quorum - 1] if len(left) >= quorum else None


def _inspect(redlock: Redlock, keys: Sequence[bytes], timeout: float) -> list[LockView]:
    """Every key of ``keys`` read on every master, INSPECT_BATCH keys per round."""
    found = []
    names = [m.name for m in redlock.masters]
    for start in range(0, len(keys), INSPECT_BATCH):
        chunk = keys[start : start + INSPECT_BATCH]
        batch = [INSPECT.pack(key, key + QUEUE_SUFFIX.encode()) for key in chunk]
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
    master did not answer it (``errors``: master -> why). ``stopped_at`` says which bound ended
    the scan before every master's had run to its end: ``"limit"`` (``limit`` keys found) or
    ``"steps"`` (MAX_SCAN_STEPS steps on some master); None when none did."""

    locks: tuple[LockView, ...]
    complete: bool
    errors: dict[str, str]
    stopped_at: Literal["limit", "steps"] | None = None


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
    scan = _Scan([m.name for m in redlock.masters], _glob_escape(redlock.key_prefix) + pattern)
    steps = 0
    with redlock._round() as rnd:
        while scan.running() and len(scan.candidates) < limit and steps < MAX_SCAN_STEPS:
            steps += 1
            scan.take(rnd.call(scan.commands(), timeout))
    keys = sorted(scan.candidates)[:limit]
    views = [view for view in _inspect(redlock, keys, timeout) if _listed(view, partial)]
    stopped_at: Literal["limit", "steps"] | None = None
    if len(scan.candidates) > limit or (scan.running() and len(scan.candidates) >= limit):
        stopped_at = "limit"
    elif scan.running():
        stopped_at = "steps"
    return Listing(tuple(views), scan.complete() and len(scan.candidates) <= limit, scan.errors, stopped_at)


class _Scan:
    """One ``SCAN ... MATCH`` on every master at once, step by step: each master's cursor (None
    once its scan is done, or it failed: ``errors`` says why) and the keys found so far, once
    each, without the keys beside a lock that are no lock (SIBLING_SUFFIXES)."""

    def __init__(self, names: Sequence[str], match: str) -> None:
        self.names = names
        self.match = match
        self.cursors: list[bytes | None] = [b"0"] * len(names)
        self.errors: dict[str, str] = {}
        self.candidates: dict[bytes, None] = {}  # a dict: without repeats, in the order found

    def running(self) -> bool:
        return any(c is not None for c in self.cursors)

    def complete(self) -> bool:
        """Whether every master's scan ran to its end."""
        return not self.errors and not self.running()

    def commands(self) -> list[Command | None]:
        """The next step's SCAN for every master still scanning."""
        return [
            None if cursor is None else ("SCAN", cursor, "MATCH", self.match, "COUNT", SCAN_COUNT)
            for cursor in self.cursors
        ]

    def take(self, outcomes: Sequence[Outcome]) -> None:
        """Every master's reply to one step: its keys, and its next cursor."""
        for i, outcome in enumerate(outcomes):
            if self.cursors[i] is None:
                continue
            reply = outcome.value
            if outcome.kind != "ok" or not isinstance(reply, list) or len(reply) != 2:
                self.errors[self.names[i]] = outcome.detail or outcome.kind
                self.cursors[i] = None
                continue
            for key in reply[1]:
                if not key.endswith(SIBLING_SUFFIXES_BYTES):
                    self.candidates[key] = None
            self.cursors[i] = None if reply[0] == b"0" else reply[0]


def _listed(view: LockView, partial: bool) -> bool:
    """Whether :func:`list_locks` lists ``view``: a key some master holds a token under, held on
    a quorum (on any master, if ``partial``)."""
    return view.kind in ("plain", "reentrant", "other") and view.token is not None and (partial or view.held)
