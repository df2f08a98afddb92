"""A hypothesis state machine that attacks the core's invariant on real servers.

The invariant (the issue's words):

1. while ``acquire()`` or ``extend()`` has just returned True, or ``owned()`` is True, no other
   client can acquire the same resource;
2. once ``release()`` has returned in a process that lives on, another client can acquire the
   resource within one round: no key of ours outlives a release;
3. no operation raises anything but our own errors (``RedlockError``, or ``ValueError`` /
   ``TypeError`` for a bad argument), and none blocks past a bound of its retry budget.

The machine interleaves lock operations of several independent clients (each its own
``Redlock``, reaching the masters through a ``ProxySet`` so the network can be slowed or cut)
with the faults Redlock claims to survive: paused masters, masters killed and restarted with
their data, masters restarted empty only after every key they held would have expired (the
documented restart rule), connections closed by the server, a slow or cut network, and forked
children that touch the locks they inherited. A restart that loses data with no delay is not
safe by the algorithm's own terms and is never generated.

After every step an independent probe (a fresh ``Redlock`` on direct connections) checks the
invariant against what the masters really hold. Holding is judged by the clock: a lock is only
compared while ``owned()`` is true both before and after the probe's round, so a lock that
expired during the probe is never mistaken for a broken one.

Each kind of step that breaks the invariant is reported, and shrunk, as a bug of its own
(``ExclusionBrokenAfterExtend``, ``ExclusionBrokenAfterForkRelease``, ...; see ``broken()``),
and every failure message carries the steps of the run that failed, for the failures that
depend on timing and do not fail again when hypothesis replays them.

Environment:

- ``REDLOCK_STATEFUL_MINUTES=30``: the long run, runs of fresh seeds until the time is up;
- ``REDLOCK_STATEFUL_SEED=<n>``: one run with that seed (every run prints its seed; timing
  still varies, so the @reproduce_failure line or hypothesis's database replays more surely);
- ``REDLOCK_STATEFUL_SKIP=extend_short,fork,...``: leave out groups of steps, to isolate one bug
  from another (see ``SKIP_GROUPS``);
- ``REDLOCK_STATEFUL_EXAMPLES`` / ``REDLOCK_STATEFUL_STEPS``: the short run's budget.

The short run takes 20-40 s on a 2-core machine when the invariant holds; when it does not,
finding, shrinking (capped at ``SHORT_SHRINK_SECONDS``) and printing take up to about 100 s.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import pytest
import redis
from hypothesis import HealthCheck, note, seed, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_redlock import Lock, Redlock, RedlockError
from celery_redlock.testing import ProxySet, ServerSet

T = TypeVar("T")

MASTERS = 5
QUORUM = MASTERS // 2 + 1
CLIENTS = 3
RESOURCES = ("r0", "r1")
# Short, so that a paused or lagging master costs little and rounds race with expiry.
REQUEST_TIMEOUT = 0.05
DRIFT_FACTOR = 0.01  # the library's default; used only to read a TTL the way the lock does
MAX_TTL = 5.0

# The probe talks to the masters directly with a longer timeout than the clients, so that a
# merely slow master still casts its vote: the probe must see what the masters hold.
PROBE_TIMEOUT = 0.1
PROBE_TTL = 0.5
# A lock with less left than this is not probed: the probe could not finish inside it. (The
# comparison itself is still guarded by owned() before and after the probe.)
MIN_PROBE_VALIDITY = 0.05

# Invariant 3's bound for one call: one attempt (retry_count=0) costs at most a connect and a
# round, each bounded by request_timeout; the yardstick is attempts x request_timeout x
# masters. Four times that plus half a second of slack for a loaded 2-core machine: generous,
# but finite, and far below what a hang or a hidden client-side retry would cost.
ATTEMPT_BUDGET = REQUEST_TIMEOUT * MASTERS
CALL_BOUND = 4 * ATTEMPT_BUDGET + 0.5
ACQUIRE_TIMEOUT = 0.1  # acquire(timeout=...) mode: the bound grows by this much

# acquire() returning True while owned() is already False is a bug only if the call outlasted
# the TTL by more than a scheduling hiccup between the library's last clock reading and its
# return could explain.
ACQUIRE_RETURN_SLACK = 0.015

# release() waits for the replies, release_without_waiting() only sends; through a healthy proxy
# either lands within microseconds. Half a second is far past that and still says "within one
# round" for a human.
RELEASE_SETTLE = 0.5
# How long a forked child may take before the parent kills it by pid.
CHILD_DEADLINE = 5.0
# Margin added to every key lifetime the machine tracks (delayed restarts wait past them).
KEY_SLACK = 0.1
# At most this many masters are faulty at once (3 of 5 loses the quorum on purpose).
MAX_IMPAIRED = 3
PROXY_DELAYS = {"proxy_slow": 0.02, "proxy_lag": 0.08}

SKIP = frozenset(
    part.strip() for part in os.environ.get("REDLOCK_STATEFUL_SKIP", "").split(",") if part.strip()
)
# The groups REDLOCK_STATEFUL_SKIP understands, and what each leaves out. client_kill,
# idle_timeout, kill, restart and proxy_cut all leave a client holding connections the masters
# have closed: skipping the five together sets aside whatever goes wrong on such a connection.
SKIP_GROUPS = {
    "extend_short": "extend with a TTL below 0.2 s (shorter than a round can promise)",
    "acquire_short": "acquire with a TTL below 0.2 s (shorter than a connect may take)",
    "fork": "every forked-child step (or fork_owned, fork_release, fork_extend, fork_with, "
    "fork_acquire for one of them)",
    "pause": "SIGSTOP/SIGCONT of a master",
    "kill": "SIGKILL of a master (it comes back with its data)",
    "restart": "immediate restart of a master with its data",
    "delayed_restart": "restart of a master without its data after every key expired",
    "client_kill": "CLIENT KILL TYPE normal on a master",
    "idle_timeout": "CONFIG SET timeout 1 on a master",
    "proxy": "slow, lagging or black-holed network to a master (bytes held, not lost)",
    "proxy_cut": "every connection through a master's proxy reset, and new ones refused",
    "bad_args": "extend with a TTL of 0 or below (must raise ConfigError)",
}
_unknown = SKIP - set(SKIP_GROUPS) - {f"fork_{a}" for a in ("owned", "release", "extend", "with", "acquire")}
if _unknown:
    raise ValueError(
        f"REDLOCK_STATEFUL_SKIP: unknown group(s) {sorted(_unknown)}; known: {sorted(SKIP_GROUPS)}"
    )

MINUTES = float(os.environ.get("REDLOCK_STATEFUL_MINUTES") or 0)
SHORT_EXAMPLES = int(os.environ.get("REDLOCK_STATEFUL_EXAMPLES") or 20)
SHORT_STEPS = int(os.environ.get("REDLOCK_STATEFUL_STEPS") or 25)
# Hypothesis gives up shrinking after this long and prints what it has; in the short run the
# whole test, shrinking included, must finish inside its pytest timeout.
SHORT_SHRINK_SECONDS = 75
SHORT_TIMEOUT = 180
# A delayed restart waits out the longest TTL in force, up to MAX_TTL; the short run only
# takes the ones that cost little, the long run all of them.
DELAYED_RESTART_CAP = 1.0 if not MINUTES else float("inf")

OUR_ERRORS = (RedlockError, ValueError, TypeError)

# What the runs exercised, printed after each: a green run that never probed proves nothing.
STATS: collections.Counter[str] = collections.Counter()


def event(what: str) -> None:
    STATS[what] += 1


def _as_bytes(reply: object) -> bytes | None:
    """A GET reply (redis-py types it loosely; without decode_responses it is bytes or None)."""
    assert reply is None or isinstance(reply, bytes), reply
    return reply


def _drift(ttl: float) -> float:
    return ttl * DRIFT_FACTOR + 0.002


# -- strategies --------------------------------------------------------------------------------
def _acquire_ttls() -> st.SearchStrategy[float]:
    # 1.0 first: hypothesis shrinks towards it, and a minimal example then holds its lock long
    # enough for the probe to see it, whatever the machine's load.
    usual = st.one_of(st.sampled_from([1.0, 0.2, 0.5, 2.0, MAX_TTL]), st.floats(0.2, MAX_TTL))
    if "acquire_short" in SKIP:
        return usual
    # Shorter than a connect to a silent master may take (request_timeout).
    return st.one_of(usual, st.sampled_from([0.01, 0.03, 0.05, 0.1]))


def _extend_ttls() -> st.SearchStrategy[float | None]:
    choices: list[st.SearchStrategy[float | None]] = [
        st.none(),  # the lock's own TTL
        st.sampled_from([1.0, 0.2, 0.5, 2.0, MAX_TTL]),
        st.floats(0.2, MAX_TTL),
    ]
    if "extend_short" not in SKIP:
        # Any size, down to one that expires the keys before the reply is back (and one that
        # rounds to 0 ms).
        choices.append(st.sampled_from([0.0005, 0.002, 0.01, 0.05, 0.1]))
        choices.append(st.floats(0.0001, 0.2))
    usual = st.one_of(*choices)
    if "bad_args" in SKIP:
        return usual
    # Now and then a TTL that is not positive: it must raise ConfigError, and change nothing.
    return st.one_of(usual, usual, usual, usual, st.sampled_from([0.0, -1.0]))


FORK_ACTIONS = [
    a
    for a in ("owned", "release", "extend", "with", "acquire")
    if "fork" not in SKIP and f"fork_{a}" not in SKIP
]
FAULTS = [
    kind
    for kind, group in (
        ("pause", "pause"),
        ("kill", "kill"),
        ("restart_with_data", "restart"),
        ("delayed_restart", "delayed_restart"),
        ("client_kill", "client_kill"),
        ("idle_timeout", "idle_timeout"),
        ("proxy_slow", "proxy"),
        ("proxy_lag", "proxy"),
        ("proxy_blackhole", "proxy"),
        ("proxy_cut", "proxy_cut"),
    )
    if group not in SKIP
]

clients_st = st.integers(0, CLIENTS - 1)
resources_st = st.sampled_from(RESOURCES)
masters_st = st.integers(0, MASTERS - 1)


@dataclass
class CallResult:
    value: Any
    error: BaseException | None
    took: float

    def __str__(self) -> str:
        return repr(self.error) if self.error is not None else repr(self.value)


@dataclass(frozen=True)
class Held:
    """A lock an acquire step tried (it may or may not have got it), and whose it is."""

    name: str
    c: int
    r: str
    lock: Lock = field(repr=False)

    def __str__(self) -> str:
        return self.name


# The steps of the example now running, as hypothesis would print them.
_TRACE: list[str] = []


class InvariantBroken(AssertionError):
    """The library broke the invariant (not the test's own trouble).

    Hypothesis prints the steps of a failure it can replay; one that depends on timing may not
    fail again on the replay, and is then reported without them. So every failure carries the
    steps of the run that failed.
    """

    def __init__(self, message: str) -> None:
        steps = "\n".join(f"    {line}" for line in ["state = InvariantMachine()", *_TRACE])
        super().__init__(f"{message}\n  steps of the run that failed:\n{steps}")


_BROKEN: dict[str, type[InvariantBroken]] = {}


def broken(what: str, step: str) -> type[InvariantBroken]:
    """The error for invariant ``what`` found broken right after a ``step`` of some kind.

    Hypothesis tells failures apart by exception type and place. The probes raise from one
    place whatever broke the lock, so without a type per cause every bug they find would be
    merged into one and shrunk to the smallest; this way each kind of step that breaks the
    invariant is reported, and shrunk, as its own bug (ExclusionBrokenAfterExtend, ...).
    """
    name = f"{what}BrokenAfter" + "".join(part.title() for part in step.split("_"))
    if name not in _BROKEN:
        _BROKEN[name] = type(name, (InvariantBroken,), {"__module__": __name__})
    return _BROKEN[name]


class InvariantMachine(RuleBasedStateMachine):
    """Clients, resources and faults; the class attributes are set by the test."""

    servers: ClassVar[ServerSet]
    proxies: ClassVar[ProxySet]

    def __init__(self) -> None:
        super().__init__()
        # The masters are as the previous example's teardown left them: running, empty.
        self.clients = [
            Redlock(self.proxies.urls, retry_count=0, request_timeout=REQUEST_TIMEOUT) for _ in range(CLIENTS)
        ]
        self.locks: dict[tuple[int, str], Lock] = {
            (c, r): self.clients[c].lock(r, ttl=1.0) for c in range(CLIENTS) for r in RESOURCES
        }
        self.history: dict[tuple[int, str], list[str]] = {key: [] for key in self.locks}
        # Releases of the last step, checked by the next invariant run: (client, resource,
        # key, token, whether everything was healthy while it was sent).
        self.just_released: list[tuple[int, str, str, str, bool]] = []
        self.proxy_fault: dict[int, str] = {}
        self.idle_timeout: set[int] = set()
        # Until when (monotonic) any key anyone set may live; a master restarts empty only
        # after this. Commands held back by a paused master or a black-holed proxy land when it
        # comes back, so their TTLs count from then.
        self.keys_until = 0.0
        self.held_back_ttl: dict[int, float] = {}
        self.step = "start"  # the kind of the step that ran last (see broken())
        self.acquisitions = 0  # names the bundle entries as hypothesis does: held_0, held_1...
        _TRACE.clear()
        self.held_back = False  # whether a pause or a proxy ever held commands back

    # -- bookkeeping -------------------------------------------------------------------------
    def _impaired(self) -> set[int]:
        return {
            m
            for m, server in enumerate(self.servers)
            if not server.running or server.paused or m in self.proxy_fault
        }

    def _healthy(self) -> bool:
        return not self._impaired()

    def _holding_back(self) -> set[int]:
        paused = {m for m, server in enumerate(self.servers) if server.running and server.paused}
        return paused | {m for m, kind in self.proxy_fault.items() if kind == "proxy_blackhole"}

    def _note_ttl(self, ttl: float | None) -> None:
        """Someone may have set a key with this TTL just now."""
        if ttl is None or ttl <= 0:
            return
        lag = max((PROXY_DELAYS.get(kind, 0.0) for kind in self.proxy_fault.values()), default=0.0)
        self.keys_until = max(self.keys_until, time.monotonic() + ttl + lag + KEY_SLACK)
        for m in self._holding_back():
            self.held_back_ttl[m] = max(self.held_back_ttl.get(m, 0.0), ttl)

    def _let_through(self, m: int) -> None:
        """Master m receives what was held back: those TTLs start now."""
        ttl = self.held_back_ttl.pop(m, 0.0)
        if ttl:
            self.keys_until = max(self.keys_until, time.monotonic() + ttl + KEY_SLACK)

    def _step(self, kind: str, call: str) -> None:
        self.step = kind
        _TRACE.append(call)

    def _remember(self, c: int, r: str, line: str) -> None:
        past = self.history[(c, r)]
        past.append(line)
        del past[:-6]

    def _call(self, label: str, fn: Callable[[], T], bound: float = CALL_BOUND) -> CallResult:
        """Run one library call; invariant 3 is checked here for every call the machine makes."""
        started = time.monotonic()
        try:
            value: Any = fn()
            error: BaseException | None = None
        except OUR_ERRORS as exc:
            value, error = None, exc
        except Exception as exc:
            raise InvariantBroken(
                f"{label} raised {type(exc).__module__}.{type(exc).__name__}, not one of our errors: {exc!r}"
            ) from exc
        took = time.monotonic() - started
        if took > bound:
            raise InvariantBroken(
                f"{label} took {took:.3f} s, past its bound of {bound:.3f} s "
                f"(request_timeout {REQUEST_TIMEOUT} s, {MASTERS} masters, faults: "
                f"{self._faults()})"
            )
        return CallResult(value, error, took)

    def _faults(self) -> str:
        parts = []
        for m, server in enumerate(self.servers):
            state = []
            if not server.running:
                state.append("down")
            elif server.paused:
                state.append("paused")
            if m in self.proxy_fault:
                state.append(self.proxy_fault[m])
            if m in self.idle_timeout:
                state.append("idle-timeout")
            if state:
                parts.append(f"m{m}={'+'.join(state)}")
        return ", ".join(parts) or "none"

    def _keys(self, key: str) -> list[str]:
        """What every master holds for ``key``, read directly (diagnostics)."""
        out = []
        for m, server in enumerate(self.servers):
            if not server.running:
                out.append(f"m{m}: down")
            elif server.paused:
                out.append(f"m{m}: paused")
            else:
                client = server.client(socket_timeout=1.0, socket_connect_timeout=1.0)
                try:
                    value = _as_bytes(client.get(key))
                    pttl = client.pttl(key)
                    shown = value.decode()[:12] + "..." if value else "-"
                    out.append(f"m{m}: {shown} pttl={pttl}")
                except redis.RedisError as exc:
                    out.append(f"m{m}: {type(exc).__name__}")
                finally:
                    client.close()
        return out

    def _values(self, key: str) -> list[bytes | None]:
        """The value of ``key`` on every master (all running and unpaused)."""
        values = []
        for server in self.servers:
            client = server.client(socket_timeout=1.0, socket_connect_timeout=1.0)
            try:
                values.append(_as_bytes(client.get(key)))
            finally:
                client.close()
        return values

    def _owners(self, r: str) -> list[int]:
        return [c for c in range(CLIENTS) if self.locks[(c, r)].owned()]

    # -- lock operations ---------------------------------------------------------------------
    # Locks that were acquired (or tried): extend, release and fork steps draw from here, and
    # so meet a held lock far more often than a random (client, resource) would.
    held = Bundle("held")

    @initialize(target=held, ttl=_acquire_ttls())
    def first_lock(self, ttl: float) -> Any:
        """Every example starts with a lock taken: hypothesis switches random rules off per
        example, and one without `acquire` would otherwise spend itself on faults alone."""
        self._new_lock(0, RESOURCES[0], ttl)
        return self._acquire(0, RESOURCES[0], "try", f"first_lock(ttl={ttl!r})")

    @rule(
        target=held,
        c=clients_st,
        r=resources_st,
        ttl=_acquire_ttls(),
        mode=st.sampled_from(["try", "block", "timeout"]),
    )
    def acquire(self, c: int, r: str, ttl: float, mode: str) -> Any:
        """Acquire on a new Lock object (the old one stays if it is still owned)."""
        if not self.locks[(c, r)].owned():
            self._new_lock(c, r, ttl)
        return self._acquire(c, r, mode, f"acquire(c={c!r}, mode={mode!r}, r={r!r}, ttl={ttl!r})")

    def _new_lock(self, c: int, r: str, ttl: float) -> None:
        """A fresh Lock object for client c on r. A TTL the library refuses (a ConfigError,
        e.g. one below what a round can promise) leaves the old object in place."""
        made = self._call(f"client {c}: lock({r!r}, ttl={ttl})", lambda: self.clients[c].lock(r, ttl=ttl))
        if made.error is None:
            self.locks[(c, r)] = made.value
        else:
            event(f"lock(ttl) -> {type(made.error).__name__}")

    @rule(target=held, c=clients_st, r=resources_st, mode=st.sampled_from(["try", "block", "timeout"]))
    def reacquire(self, c: int, r: str, mode: str) -> Any:
        """Acquire again on the Lock object last used: after its release, after it expired, or
        while it is still owned (which must raise RedlockError)."""
        return self._acquire(c, r, mode, f"reacquire(c={c!r}, mode={mode!r}, r={r!r})")

    def _acquire(self, c: int, r: str, mode: str, call_text: str) -> Any:
        name = f"held_{self.acquisitions}"
        self.acquisitions += 1
        self._step("acquire", f"{name} = state.{call_text}")
        lock = self.locks[(c, r)]
        ttl = lock.ttl
        if mode == "try":
            call: Callable[[], bool] = lambda: lock.acquire(blocking=False)  # noqa: E731
            bound = CALL_BOUND
        elif mode == "block":
            call = lambda: lock.acquire()  # noqa: E731
            bound = CALL_BOUND
        else:
            call = lambda: lock.acquire(timeout=ACQUIRE_TIMEOUT)  # noqa: E731
            # Attempts until the timeout, each bounded; the last may start just before it.
            bound = ACQUIRE_TIMEOUT + CALL_BOUND
        self._note_ttl(ttl)
        result = self._call(f"client {c}: acquire({r!r}, ttl={ttl}, {mode})", call, bound)
        owned_after = lock.owned()
        validity = lock.validity
        event(f"acquire -> {type(result.error).__name__ if result.error else result.value}")
        self._remember(
            c,
            r,
            f"acquire(ttl={ttl}, {mode}) -> {result} in {result.took * 1000:.1f} ms, validity {validity:.3f}",
        )
        if result.value is not True:
            # Into the bundle all the same: whether a round succeeds depends on timing, and
            # hypothesis needs the same draws to build the same bundle on every replay.
            return Held(name, c, r, lock)
        if not owned_after and result.took > ttl - _drift(ttl) + ACQUIRE_RETURN_SLACK:
            raise InvariantBroken(
                f"client {c}: acquire({r!r}, ttl={ttl}) returned True after "
                f"{result.took * 1000:.1f} ms, but owned() is already False: the validity "
                f"it returned on did not count the whole call; votes: "
                f"{[str(v) for v in lock.last_votes]}; faults: {self._faults()}"
            )
        if validity > ttl:
            raise InvariantBroken(f"client {c}: validity {validity} exceeds the ttl {ttl}")
        return Held(name, c, r, lock)

    # Extend and release take their lock from `held`: it may have expired or been released
    # since (an entry stays until a release consumes it), so they meet locks in every state.
    @rule(held=held, ttl=_extend_ttls())
    def extend(self, held: Held, ttl: float | None) -> None:
        self._step("extend", f"state.extend(held={held}, ttl={ttl!r})")
        c, r, lock = held.c, held.r, held.lock
        before = lock.validity
        if lock.token is not None:  # only a lock with a token sends anything
            self._note_ttl(ttl if ttl is not None else lock.ttl)
        result = self._call(f"client {c}: extend({r!r}, ttl={ttl})", lambda: lock.extend(ttl))
        event(f"extend -> {type(result.error).__name__ if result.error else result.value}")
        self._remember(
            c,
            r,
            f"extend(ttl={ttl}) -> {result} (validity {before:.3f} -> {lock.validity:.3f}, "
            f"votes {[v.kind for v in lock.last_votes]})",
        )
        if ttl is not None and ttl <= 0 and result.error is None:
            raise InvariantBroken(f"extend(ttl={ttl}) was accepted; a TTL must be positive")
        if result.value is True and not lock.owned():
            effective = lock.ttl if ttl is None else ttl
            if result.took > effective - _drift(effective) + ACQUIRE_RETURN_SLACK:
                raise InvariantBroken(
                    f"client {c}: extend({r!r}, ttl={ttl}) returned True after "
                    f"{result.took * 1000:.1f} ms, but owned() is already False"
                )

    @rule(held=consumes(held), waited=st.booleans())
    def release(self, held: Held, waited: bool) -> None:
        self._step("release", f"state.release(held={held}, waited={waited!r})")
        c, r, lock = held.c, held.r, held.lock
        event("release" if lock.token is not None else "release (nothing held)")
        token = lock.token
        healthy = self._healthy()
        how = lock.release if waited else lock.release_without_waiting
        result = self._call(f"client {c}: {how.__name__}({r!r})", how)
        self._remember(c, r, f"{how.__name__}() -> {result} (token {token and token[:8]})")
        if result.error is not None:
            raise InvariantBroken(f"client {c}: {how.__name__}({r!r}) raised {result.error!r}")
        if lock.owned():
            raise InvariantBroken(f"client {c}: owned() is True after {how.__name__}({r!r})")
        if waited and result.value not in (True, False):
            raise InvariantBroken(f"client {c}: release({r!r}) returned {result.value!r}, not a bool")
        if token is None:
            return
        if result.value is True:
            self._check_answered_release(c, r, lock.key, token)
        self.just_released.append((c, r, lock.key, token, healthy))

    def _check_answered_release(self, c: int, r: str, key: str, token: str) -> None:
        """release() returned True: a quorum answered, so at most a minority can still hold
        the token (late links may still be on their way), read at once, with no settling."""
        if not all(server.running and not server.paused for server in self.servers):
            return  # a master that cannot be read now
        event("invariant 2: an answered release checked at once")
        left_on = [m for m, value in enumerate(self._values(key)) if value == token.encode()]
        if len(left_on) > MASTERS - QUORUM:
            raise broken("QuorumAfterRelease", self.step)(
                f"client {c}: release({r!r}) returned True, yet masters {left_on} still hold its "
                f"token: {self._keys(key)}; faults: {self._faults()}; history: {self.history[(c, r)]}"
            )

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5]))
    def wait(self, seconds: float) -> None:
        self._step("wait", f"state.wait(seconds={seconds!r})")
        event("wait")
        # Let time pass so validities run out between the other steps.
        time.sleep(seconds)

    # -- forked children ---------------------------------------------------------------------
    @precondition(lambda self: bool(FORK_ACTIONS))
    @rule(
        held=held,
        action=st.sampled_from(FORK_ACTIONS or ["owned"]),
        ttl=st.sampled_from([0.002, 0.2, 1.0, MAX_TTL]),
        other=resources_st,
    )
    def fork_child(self, held: Held, action: str, ttl: float, other: str) -> None:
        """A child of fork does something with a Lock its parent holds, or takes its own lock
        on the inherited Redlock; the parent's lock must be untouched (DESIGN: after fork a
        lock is not owned in the child, and nothing the child does touches it on the
        masters)."""
        self._step(
            f"fork_{action}",
            f"state.fork_child(action={action!r}, held={held}, other={other!r}, ttl={ttl!r})",
        )
        c, r, lock = held.c, held.r, held.lock
        owned_before = lock.owned()
        holders_before = self._owners(other)
        if action == "acquire" or (action == "extend" and lock.token is not None):
            self._note_ttl(ttl)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            os.close(read_end)
            _child(write_end, action, lock, self.clients[c], ttl, other)
        os.close(write_end)
        report = _read_report(read_end, pid, time.monotonic() + CHILD_DEADLINE)
        event(f"fork {action}" + (" (parent owns)" if owned_before else ""))
        self._remember(
            c,
            r,
            f"fork {action}(ttl={ttl}, other={other!r}) -> {report} (parent owned before: {owned_before})",
        )
        if report is None:
            raise InvariantBroken(
                f"forked child of client {c} doing {action} on {r!r} hung past "
                f"{CHILD_DEADLINE} s and was killed; faults: {self._faults()}"
            )
        if report.get("foreign_error"):
            raise InvariantBroken(
                f"forked child of client {c} doing {action} on {r!r} raised "
                f"{report['foreign_error']}, not one of our errors"
            )
        if report.get("took", 0.0) > CALL_BOUND:
            raise InvariantBroken(f"forked child's {action} took {report['took']:.3f} s, past {CALL_BOUND} s")
        if report.get("owned") or report.get("extended"):
            raise InvariantBroken(
                f"a forked child of client {c} sees the parent's lock on {r!r} as its own "
                f"({action}: {report}); parent owned it before the fork: {owned_before}"
            )
        if report.get("acquired"):
            still = [h for h in holders_before if self.locks[(h, other)].owned()]
            if still:
                raise InvariantBroken(
                    f"a forked child acquired {other!r} while client(s) {still} owned it from "
                    f"before the fork until after the child exited; child votes: "
                    f"{report.get('votes')}; keys: {self._keys(self.locks[(still[0], other)].key)}"
                )

    # -- faults ------------------------------------------------------------------------------
    @precondition(lambda self: bool(FAULTS))
    @rule(kind=st.sampled_from(FAULTS or ["pause"]), m=masters_st)
    def fault(self, kind: str, m: int) -> None:
        self._step(kind, f"state.fault(kind={kind!r}, m={m!r})")
        event(f"fault {kind}")
        server = self.servers[m]
        impaired = self._impaired()
        if kind in ("pause", "kill", *PROXY_DELAYS, "proxy_blackhole", "proxy_cut") and (
            m not in impaired and len(impaired) >= MAX_IMPAIRED
        ):
            note(f"fault {kind} on m{m} skipped: {len(impaired)} masters already impaired")
            return
        if kind == "pause":
            if server.running and not server.paused:
                server.pause()
                self.held_back = True
        elif kind == "kill":
            if server.paused:
                self._let_through(m)  # SIGCONT comes first: it may apply what it held
            server.kill()
            self.idle_timeout.discard(m)
        elif kind == "restart_with_data":
            if server.paused:
                self._let_through(m)
            # Safe with appendfsync always: every key comes back with its own expiry.
            server.restart(keep_data=True)
            self.idle_timeout.discard(m)
        elif kind == "delayed_restart":
            if server.paused:
                self._let_through(m)
            # The restart rule: an empty master must stay out until every key it may have
            # held has expired (here, every key anyone may hold; the largest TTL at most).
            delay = max(0.0, self.keys_until - time.monotonic()) + KEY_SLACK
            if delay > DELAYED_RESTART_CAP:
                note(f"delayed restart of m{m} skipped: it would wait {delay:.2f} s")
                return
            note(f"m{m} restarts empty after {delay:.2f} s")
            server.restart(keep_data=False, delay=delay)
            self.idle_timeout.discard(m)
        elif kind == "client_kill":
            if server.running and not server.paused:
                admin = server.client()
                try:
                    admin.client_kill_filter(_type="normal", skipme=True)
                finally:
                    admin.close()
        elif kind == "idle_timeout":
            # The server closes connections idle for a second from now on, as many production
            # configurations do (`timeout 300`, only sooner).
            if server.running and not server.paused:
                admin = server.client()
                try:
                    admin.config_set("timeout", 1)
                finally:
                    admin.close()
                self.idle_timeout.add(m)
        else:
            proxy = self.proxies[m]
            if m in self.proxy_fault:
                self._heal_proxy(m)
            if kind in PROXY_DELAYS:
                proxy.delay(PROXY_DELAYS[kind])
            elif kind == "proxy_blackhole":
                proxy.blackhole()
            else:
                proxy.cut()
            self.proxy_fault[m] = kind
            self.held_back = True

    def _heal_proxy(self, m: int) -> None:
        kind = self.proxy_fault.pop(m)
        proxy = self.proxies[m]
        proxy.heal()
        if kind == "proxy_blackhole":
            self._let_through(m)
        # What the proxy held or delayed is delivered before the master counts as healthy
        # again: the release checks assume nothing of ours is still on its way.
        deadline = time.monotonic() + 1.0
        while proxy.pending() and time.monotonic() < deadline:
            time.sleep(0.005)

    @rule(m=masters_st)
    def heal(self, m: int) -> None:
        """Undo whatever is wrong with master m: resume, start with its data, heal the proxy,
        no idle timeout."""
        self._step("heal", f"state.heal(m={m!r})")
        event("heal")
        server = self.servers[m]
        if server.paused:
            server.resume()
            self._let_through(m)
            # A command on a new connection is served after the backlog the master found on
            # waking: once this answers, what it held is applied.
            admin = server.client()
            try:
                admin.ping()
            finally:
                admin.close()
        if not server.running:
            server.start()  # the append-only file brings its keys back
        if m in self.proxy_fault:
            self._heal_proxy(m)
        if m in self.idle_timeout:
            admin = server.client()
            try:
                admin.config_set("timeout", 0)
            finally:
                admin.close()
            self.idle_timeout.discard(m)

    # -- the invariant -------------------------------------------------------------------------
    @invariant()
    def no_two_holders(self) -> None:
        # Validity only shrinks between steps, so a lock found owned later in this pass was
        # also owned when the earlier one was looked at: two owners means an overlap.
        for r in RESOURCES:
            owners = [(c, self.locks[(c, r)].validity) for c in range(CLIENTS) if self.locks[(c, r)].owned()]
            if len(owners) > 1:
                raise broken("SingleHolder", self.step)(
                    f"clients {owners} (client, validity) all own {r!r} at once; histories: "
                    + "; ".join(f"c{c}: {self.history[(c, r)]}" for c, _ in owners)
                )

    @invariant()
    def probe_agrees(self) -> None:
        targets = [(c, r) for (c, r), lock in self.locks.items() if lock.validity > MIN_PROBE_VALIDITY]
        released, self.just_released = self.just_released, []
        if not targets and not released:
            return
        probe = Redlock(self.servers.urls, retry_count=0, request_timeout=PROBE_TIMEOUT)
        try:
            for c, r in targets:
                self._probe_owned(probe, c, r)
            for c, r, key, token, healthy in released:
                if healthy and self._healthy():
                    self._probe_released(probe, c, r, key, token)
        finally:
            probe.close()

    def _probe_owned(self, probe: Redlock, c: int, r: str) -> None:
        """Invariant 1: while client c owns r, nobody else can acquire it."""
        lock = self.locks[(c, r)]
        before = lock.validity
        if before <= MIN_PROBE_VALIDITY:
            return
        attempt = probe.lock(r, ttl=PROBE_TTL)
        self._note_ttl(PROBE_TTL)
        got = self._call(f"probe acquire({r!r})", lambda: attempt.acquire(blocking=False))
        after = lock.validity
        event("invariant 1: an owned lock probed")
        if got.value is not True:
            return
        votes = [str(v) for v in attempt.last_votes]
        keys = self._keys(lock.key)
        attempt.release()
        if after > 0:  # owned before and after the probe's round: owned throughout it
            raise broken("Exclusion", self.step)(
                f"a fresh client acquired {r!r} while client {c}'s lock says owned() "
                f"(validity {before:.3f} s before the probe, {after:.3f} s after); probe votes: "
                f"{votes}; holder's last votes: {[str(v) for v in lock.last_votes]}; keys then: "
                f"{keys}; faults: {self._faults()}; client {c}'s history on {r!r}: "
                f"{self.history[(c, r)]}"
            )
        note(f"probe took {r!r} from client {c}, whose lock expired during the probe")

    def _probe_released(self, probe: Redlock, c: int, r: str, key: str, token: str) -> None:
        """Invariant 2: after client c released r (all masters healthy), no key of that token is
        left, and if nobody else holds r, a fresh client takes it in one round."""
        deadline = time.monotonic() + RELEASE_SETTLE
        values = self._values(key)
        while token.encode() in values and time.monotonic() < deadline:
            time.sleep(0.005)
            values = self._values(key)
        left_on = [m for m, value in enumerate(values) if value == token.encode()]
        if left_on:
            raise broken("NoKeyAfterRelease", self.step)(
                f"client {c} released {r!r} {RELEASE_SETTLE} s ago with every master up, and "
                f"its key is still on master(s) {left_on}: {self._keys(key)}; faults: "
                f"{self._faults()}; history: {self.history[(c, r)]}"
            )
        event("invariant 2: a released token checked on every master")
        if self._owners(r):
            return
        holding = [m for m, value in enumerate(values) if value is not None]
        if len(holding) > MASTERS - QUORUM:
            return  # other tokens' keys (expired locks that were never released) still block it
        attempt = probe.lock(r, ttl=PROBE_TTL)
        self._note_ttl(PROBE_TTL)
        got = self._call(f"probe acquire({r!r}) after release", lambda: attempt.acquire(blocking=False))
        if got.value is True:
            event("invariant 2: acquired after a release")
            attempt.release()
            return
        raise broken("FreeAfterRelease", self.step)(
            f"client {c} released {r!r}, nobody owns it and only masters {holding} hold a key, "
            f"yet a fresh client could not acquire it in one round: "
            f"{[str(v) for v in attempt.last_votes]}; keys: {self._keys(key)}"
        )

    # -- between examples ----------------------------------------------------------------------
    def teardown(self) -> None:
        # Every master back to running, unpaused, reachable and empty, whatever the example did.
        for client in self.clients:
            with contextlib.suppress(*OUR_ERRORS):
                client.close()
        self.proxies.heal()
        # Bytes a proxy held or delayed are still on their way, and a paused master has
        # commands queued: let them land before the flush, or a late SET leaks into the next
        # example.
        deadline = time.monotonic() + 2.0
        while self.proxies.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.servers.ensure_running()
        if self.held_back:
            time.sleep(max(PROXY_DELAYS.values()) + 0.05)
        for server in self.servers:
            admin = server.client()
            try:
                if self.idle_timeout:
                    admin.config_set("timeout", 0)
                admin.flushall()
            finally:
                admin.close()


# -- the forked child ------------------------------------------------------------------------
def _child(write_end: int, action: str, lock: Lock, rl: Redlock, ttl: float, other: str) -> None:
    """Runs in the child; reports one JSON line through the pipe and leaves by os._exit, so
    nothing of the parent's (pytest, hypothesis, atexit) runs here."""
    report: dict[str, Any] = {"action": action}
    started = time.monotonic()
    try:
        if action == "owned":
            report["owned"] = lock.owned()
        elif action == "release":
            lock.release()
        elif action == "extend":
            report["extended"] = lock.extend(ttl)
        elif action == "with":
            # As if the parent had forked inside `with lock:` and the child left by sys.exit:
            # the with statement's exit runs in the child.
            stack = contextlib.ExitStack()
            stack.push(lock)
            try:
                with stack:
                    sys.exit(0)
            except SystemExit:
                report["unwound"] = True
        else:
            own = rl.lock(other, ttl=ttl)
            got = own.acquire(blocking=False)
            report["acquired"] = got
            report["votes"] = [str(v) for v in own.last_votes]
            if got:
                own.release()
    except OUR_ERRORS as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    except BaseException as exc:
        report["foreign_error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc!r}"
    finally:
        report["took"] = time.monotonic() - started
        try:
            os.write(write_end, json.dumps(report).encode())
        finally:
            os._exit(0)


def _read_report(read_end: int, pid: int, deadline: float) -> dict[str, Any] | None:
    """The child's report, or None if it did not finish by ``deadline`` (it is then killed)."""
    chunks: list[bytes] = []
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            ready, _, _ = select.select([read_end], [], [], remaining)
            if not ready:
                continue
            data = os.read(read_end, 65536)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not chunks:  # it died before it could write a word (a crash in the child)
        return {"foreign_error": f"the child died without a report, wait status {status}"}
    report: dict[str, Any] = json.loads(b"".join(chunks))
    return report


# -- the test ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[ServerSet, ProxySet]]:
    """Five persistent masters of our own (faults here must not leak into other tests) and
    one proxy per master for the clients."""
    with (
        ServerSet(MASTERS, persistent=True) as servers,
        ProxySet([s.address for s in servers], name="invariant") as proxies,
    ):
        yield servers, proxies


def _settings(max_examples: int, steps: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        # Real servers, sleeps and delayed restarts: a step's duration says nothing about the
        # library, and the health checks for slow generation would only get in the way.
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,  # a fresh seed per run, printed by _run
        print_blob=True,  # the @reproduce_failure line, for a failure that depends on its data
        # Each kind of step that breaks the invariant is its own bug (see broken()): report
        # and shrink every one, not only the first.
        report_multiple_bugs=True,
    )


def _run(seed_value: int, max_examples: int, steps: int) -> None:
    print(
        f"\nREDLOCK_STATEFUL_SEED={seed_value} (examples={max_examples}, steps={steps}, "
        f"skip={','.join(sorted(SKIP)) or '-'})",
        flush=True,
    )
    STATS.clear()
    started = time.monotonic()
    try:
        # hypothesis.stateful ships without annotations for this function.
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            seed(seed_value)(InvariantMachine), settings=_settings(max_examples, steps)
        )
    finally:
        print(f"{time.monotonic() - started:.1f} s; exercised: {dict(sorted(STATS.items()))}")


def _seeds() -> Iterator[int]:
    fixed = os.environ.get("REDLOCK_STATEFUL_SEED")
    if fixed:
        yield int(fixed)
        return
    while True:
        yield random.SystemRandom().getrandbits(64)


@pytest.mark.timeout(SHORT_TIMEOUT if not MINUTES else int(MINUTES * 60) + 600)
def test_the_invariant_holds_under_faults(
    cluster: tuple[ServerSet, ProxySet], monkeypatch: pytest.MonkeyPatch
) -> None:
    servers, proxies = cluster
    InvariantMachine.servers = servers
    InvariantMachine.proxies = proxies
    servers.ensure_running()
    proxies.heal()
    if not MINUTES:
        # Hypothesis documents this knob for exactly this: shrinking must end inside the
        # pytest timeout, or the minimal example is never printed.
        monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", SHORT_SHRINK_SECONDS)
        _run(next(_seeds()), SHORT_EXAMPLES, SHORT_STEPS)
        return
    # The long run: fresh seeds, one run after another, until the time is up.
    until = time.monotonic() + MINUTES * 60
    runs = 0
    for seed_value in _seeds():
        if time.monotonic() >= until:
            break
        _run(seed_value, 20, 40)
        runs += 1
    print(f"{runs} runs in {MINUTES} minutes, the invariant held")
