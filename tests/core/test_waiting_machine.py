"""A hypothesis state machine that attacks waiting woken by the release, on real servers.

Design: docs/design/waiting.md section 2 and the ``WaitingMachine`` paragraph of section 5.
Holders release, die (abandon the lock, which must then expire) or extend; waiter threads call
``acquire(timeout=...)`` with 0, a finite timeout or ``inf`` (ended by ``cancelled``); the nemeses
kill the masters' pubsub connections (``CLIENT KILL TYPE pubsub``), hold a master's bytes in its
proxy (a network pause), SIGSTOP a master, and swallow what a master sends on its listening links
only (a proxy that drops the server's bytes on connections that sent SUBSCRIBE).

Invariants, checked after every step:

1. exclusion: no two holds overlap in the shared log (``testing.overlap``), a hold being the window
   from ``acquire()`` returning True to the earlier of the release and the end of the validity;
2. every ``acquire`` returns by its deadline + ``request_timeout`` + slack (after a cancel: one
   sleep slice + ``request_timeout`` + slack);
3. liveness: no waiter with time left is still waiting once the resource has been free on a
   quorum of reachable masters for longer than ``wait_poll + request_timeout`` + slack. A
   background monitor reads the masters directly every few milliseconds to know when the
   resource is free; a master counts as reachable only once a reconnect after its fault could
   have finished (``masters.BACKOFF_CAP``);
4. at most one listening (pubsub) connection per master per Redlock, told apart by the client
   name each Redlock gives its connections.

Environment: ``REDLOCK_WAITING_SEED=<n>`` replays one seed (every run prints its seed);
``REDLOCK_WAITING_EXAMPLES`` / ``REDLOCK_WAITING_STEPS`` change the budget. The short run takes
30-60 s on a 2-core machine.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import random
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
from hypothesis import HealthCheck, note, seed, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_redlock import Lock, Redlock, RedlockError
from celery_redlock.lock import subscriber as subscriber_module
from celery_redlock.lock.clock import now
from celery_redlock.lock.masters import BACKOFF_CAP
from celery_redlock.testing import Hold, Proxy, ProxySet, ServerSet, find_overlaps
from celery_redlock.testing.proxy import _Pipe
from celery_redlock.testing.stalls import StallMeter

pytestmark = pytest.mark.explore

MASTERS = 5
QUORUM = MASTERS // 2 + 1
CLIENTS = 2  # two Redlocks: two processes' worth of subscribers
RESOURCE = "waiting-machine"
REQUEST_TIMEOUT = 0.05
WAIT_POLL = 0.5
RETRY_DELAY = 0.05
TTLS = (0.3, 0.8, 1.5)
FINITE_TIMEOUTS = (0.3, 1.0, 2.0)
MAX_PENDING = 4
# At most this many masters unreachable at once: a quorum stays reachable, so liveness is owed.
MAX_IMPAIRED = 2

# A loaded 2-core machine (others run tests too) delays threads by tens of milliseconds.
SLACK = 0.3
# Invariant 2: the last attempt may start just before the deadline and take request_timeout
# (its retraction is sent, not waited for); after a cancel, one sleep slice (0.5 s) comes first.
RETURN_BOUND = REQUEST_TIMEOUT + SLACK
CANCEL_BOUND = 0.5 + REQUEST_TIMEOUT + SLACK
# Invariant 3: the fallback poll, one round, and slack for the load and the monitor's sampling.
LIVENESS_BOUND = WAIT_POLL + REQUEST_TIMEOUT + 0.5
# A master back from a fault is reachable for the clients once their reconnect, retried at most
# BACKOFF_CAP after the last failure, had time to finish.
REJOIN = BACKOFF_CAP + REQUEST_TIMEOUT + 0.1
MONITOR_EVERY = 0.01
# A listening link closed through a proxy that held its bytes lingers on the master until the
# proxy passes the close on: a second link of one Redlock must be gone within this long.
LISTENER_SETTLE = 1.0

SUBSCRIBER_TIMERS = {"ROOM_LINGER": 0.3, "IDLE_EXIT": 1.0, "PING_EVERY": 0.5, "PONG_WITHIN": 0.3}

SEED = os.environ.get("REDLOCK_WAITING_SEED")
EXAMPLES = int(os.environ.get("REDLOCK_WAITING_EXAMPLES") or 60)
STEPS = int(os.environ.get("REDLOCK_WAITING_STEPS") or 15)
SHRINK_SECONDS = 40
TIMEOUT = 200

OUR_ERRORS = (RedlockError, ValueError, TypeError)
masters = st.integers(0, MASTERS - 1)


class SwallowingProxy(Proxy):
    """A proxy that can drop what the master sends, only on connections that sent SUBSCRIBE.

    The design's ``swallow_pubsub()``: a listening link that is up but silent (notices, subscribe
    confirmations and pongs all lost), while rounds through the same proxy go on untouched.
    Whole queued chunks are dropped, never a part of one.
    """

    def __init__(self, target: str, *, name: str = "") -> None:
        super().__init__(target, name=name)
        self.swallowing = False
        self._listening: list[_Pipe] = []

    def swallow_pubsub(self) -> None:
        self._control(lambda: setattr(self, "swallowing", True))

    def heal(self) -> None:
        self._control(lambda: setattr(self, "swallowing", False))
        super().heal()

    def _flush(self, pipe: _Pipe) -> None:
        # Runs on the proxy thread each time bytes were queued, before they are passed on.
        self._listening = [p for p in self._listening if p in self._pipes]
        if pipe not in self._listening and (
            b"SUBSCRIBE" in pipe.up.out or any(b"SUBSCRIBE" in chunk for _, chunk in pipe.up.queue)
        ):
            self._listening.append(pipe)
        if self.swallowing and pipe in self._listening:
            kept = [(due, chunk) for due, chunk in pipe.down.queue if not chunk]  # closes go on
            pipe.down.queue.clear()
            pipe.down.queue.extend(kept)
        super()._flush(pipe)


class SwallowingProxySet(ProxySet):
    def __init__(self, targets: Iterable[str], *, name: str = "") -> None:
        self.name = name
        self.swallowers = [SwallowingProxy(t, name=f"proxy-{name}{i}") for i, t in enumerate(targets)]
        self.proxies: list[Proxy] = list(self.swallowers)


@dataclass(eq=False)
class Waiter:
    """One acquire(timeout=...) call on a thread of its own, and the hold it got, if any."""

    n: int
    c: int
    mode: str  # "zero", "finite" or "inf"
    timeout: float
    lock: Lock
    started: float
    cancel: threading.Event = field(default_factory=threading.Event)
    cancelled_at: float | None = None
    thread: threading.Thread | None = None
    returned: float | None = None
    result: bool | None = None
    error: BaseException | None = None
    validity_at_return: float = 0.0
    # The hold: [returned, until) while this waiter holds; until moves with extensions and ends
    # at the release. ``holding``: the machine may still release, extend or abandon it.
    until: float = 0.0
    holding: bool = False
    history: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"w{self.n}(c{self.c},{self.mode}{'' if self.mode == 'inf' else f' {self.timeout}'})"

    @property
    def pending(self) -> bool:
        return self.returned is None

    @property
    def deadline(self) -> float:
        return self.started + self.timeout

    def bound(self) -> float:
        """When the call must have returned by (invariant 2)."""
        limit = self.deadline + RETURN_BOUND
        if self.cancelled_at is not None:
            limit = min(limit, self.cancelled_at + CANCEL_BOUND)
        return limit

    def run(self) -> None:
        try:
            got = self.lock.acquire(timeout=self.timeout, cancelled=self.cancel.is_set)
            at = now()
            validity = self.lock.validity
        except BaseException as exc:  # reported by the invariants
            self.error = exc
            self.returned = now()
            return
        if got:
            self.until = at + validity
            self.validity_at_return = validity
            self.holding = True
        self.result = got
        self.returned = at


# The steps of the example now running, for failures that depend on timing (hypothesis may not
# replay them).
_TRACE: list[str] = []
_generation = itertools.count()


class WaitingBroken(AssertionError):
    def __init__(self, message: str) -> None:
        steps = "\n".join(f"    {line}" for line in ["state = WaitingMachine()", *_TRACE])
        super().__init__(f"{message}\n  steps of the run that failed:\n{steps}")


class WaitingMachine(RuleBasedStateMachine):
    servers: ServerSet
    proxies: SwallowingProxySet

    def __init__(self) -> None:
        super().__init__()
        _TRACE.clear()
        self.generation = next(_generation)
        self.names = [f"wm{self.generation}c{c}" for c in range(CLIENTS)]
        self.clients = [
            Redlock(
                [f"{url}?client_name={self.names[c]}" for url in self.proxies.urls],
                request_timeout=REQUEST_TIMEOUT,
                retry_delay=RETRY_DELAY,
                wait_poll=WAIT_POLL,
            )
            for c in range(CLIENTS)
        ]
        self.key = self.clients[0].lock(RESOURCE).key
        self.waiters: list[Waiter] = []
        self.fault: dict[int, str] = {}  # master -> "sigstop" / "proxy_pause" (unreachable)
        self.swallowed: set[int] = set()
        self.healed_at = [0.0] * MASTERS  # when each master's last fault ended
        self.violations: list[str] = []
        self.monitor_samples = 0
        self.free_seen = 0
        self._stop = threading.Event()
        self._admins = [
            server.client(socket_timeout=0.2, socket_connect_timeout=0.2) for server in self.servers
        ]
        self._monitor = threading.Thread(target=self._watch, name="waiting-monitor", daemon=True)
        self._monitor.start()

    # -- bookkeeping -------------------------------------------------------------------------------
    def _trace(self, line: str) -> None:
        _TRACE.append(f"[{now():.3f}] {line}")
        STATS["step " + line.split("(")[0].removeprefix("state.")] += 1

    def _holders(self) -> list[Waiter]:
        return [w for w in self.waiters if w.holding]

    def _pending(self) -> list[Waiter]:
        return [w for w in self.waiters if w.pending]

    def _impaired(self) -> set[int]:
        return set(self.fault)

    def _faults(self) -> str:
        parts = [f"m{m}={kind}" for m, kind in sorted(self.fault.items())]
        parts += [f"m{m}=swallow" for m in sorted(self.swallowed)]
        return ", ".join(parts) or "none"

    def _describe(self, waiter: Waiter) -> str:
        votes = [str(v) for v in waiter.lock.last_votes]
        return (
            f"{waiter.name}: started {waiter.started:.3f}, returned {waiter.returned}, result "
            f"{waiter.result}, error {waiter.error!r}, last votes {votes}, history {waiter.history}"
        )

    # -- the monitor (invariant 3) -----------------------------------------------------------------
    def _reachable(self, at: float) -> list[int]:
        return [m for m in range(MASTERS) if m not in self.fault and at - self.healed_at[m] > REJOIN]

    def _free(self, at: float) -> bool:
        """Whether no key of the resource is on a quorum of the masters the clients can reach
        (read directly, not through the proxies), and nobody owns it."""
        if any(w.lock.owned() for w in self.waiters if w.result):
            return False
        free = 0
        for m in self._reachable(at):
            try:
                if self._admins[m].exists(self.key) == 0:
                    free += 1
            except redis.RedisError:
                continue  # paused meanwhile: unknown, so not free
        return free >= QUORUM

    def _watch(self) -> None:
        free_since: float | None = None
        reported: set[int] = set()
        while not self._stop.wait(MONITOR_EVERY):
            at = now()
            self.monitor_samples += 1
            if not self._free(at):
                free_since = None
                continue
            self.free_seen += 1
            if free_since is None:
                free_since = at
            t = now()
            for waiter in list(self.waiters):
                if (
                    not waiter.pending
                    or waiter.mode == "zero"
                    or waiter.cancel.is_set()
                    or waiter.n in reported
                ):
                    continue
                since = max(free_since, waiter.started)
                bound = LIVENESS_BOUND + STALLS.stalled(since, t)
                if t - since > bound and waiter.deadline >= since + bound:
                    reported.add(waiter.n)
                    subscriber = self.clients[waiter.c]._subscriber
                    self.violations.append(
                        f"{waiter.name} still waits {t - since:.3f} s after the resource was free "
                        f"on a quorum of reachable masters (since {free_since:.3f}; bound "
                        f"{bound:.2f} s with measured stalls; its deadline {waiter.deadline:.3f}); faults: "
                        f"{self._faults()}; listening links of c{waiter.c}: "
                        f"{subscriber.listening()}; {self._describe(waiter)}"
                    )

    # -- steps ---------------------------------------------------------------------------------------
    @initialize(ttl=st.sampled_from(TTLS))
    def first_holder(self, ttl: float) -> None:
        """Every example starts held, so the first waiters have something to wait for."""
        self._trace(f"state.first_holder(ttl={ttl!r})")
        waiter = self._start(0, "zero", 0.0, ttl)
        assert waiter.thread is not None
        waiter.thread.join(5)

    @initialize(
        first=st.lists(
            st.tuples(
                st.integers(0, CLIENTS - 1),
                st.sampled_from(["finite", "inf", "zero"]),
                st.sampled_from(FINITE_TIMEOUTS),
                st.sampled_from(TTLS),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def first_waiters(self, first: list[tuple[int, str, float, float]]) -> None:
        """Waiters from the start: hypothesis switches rules off per example, and one without
        start_waiter would otherwise only hold and fault."""
        for c, mode, timeout, ttl in first:
            self.start_waiter(c, mode, timeout, ttl)

    def _start(self, c: int, mode: str, timeout: float, ttl: float) -> Waiter:
        waiter = Waiter(len(self.waiters), c, mode, timeout, self.clients[c].lock(RESOURCE, ttl=ttl), now())
        waiter.thread = threading.Thread(target=waiter.run, name=f"waiter-{waiter.n}", daemon=True)
        self.waiters.append(waiter)
        waiter.thread.start()
        return waiter

    @rule(
        c=st.integers(0, CLIENTS - 1),
        mode=st.sampled_from(["finite", "inf", "zero"]),
        timeout=st.sampled_from(FINITE_TIMEOUTS),
        ttl=st.sampled_from(TTLS),
    )
    def start_waiter(self, c: int, mode: str, timeout: float, ttl: float) -> None:
        # Preconditions must not depend on timing (hypothesis replays the draws): too many
        # waiters make this step a no-op instead.
        if len(self._pending()) >= MAX_PENDING:
            self._trace(f"state.start_waiter(c={c}, mode={mode!r}, timeout={timeout}, ttl={ttl})  # skipped")
            return
        wait = {"zero": 0.0, "finite": timeout, "inf": math.inf}[mode]
        waiter = self._start(c, mode, wait, ttl)
        self._trace(
            f"state.start_waiter(c={c}, mode={mode!r}, timeout={timeout}, ttl={ttl})  # {waiter.name}"
        )

    def _pick(self, candidates: list[Waiter], pick: int) -> Waiter | None:
        return candidates[pick % len(candidates)] if candidates else None

    @rule(pick=st.integers(0, 3), waited=st.booleans())
    def release(self, pick: int, waited: bool) -> None:
        """release() (replies waited for) or release_without_waiting() (each link owes the
        reply, read by its next use, which a waiter's round may be)."""
        holder = self._pick(self._holders(), pick)
        if holder is None:
            self._trace(f"state.release(pick={pick}, waited={waited})  # nobody holds")
            return
        self._trace(f"state.release(pick={pick}, waited={waited})  # {holder.name}")
        at = now()
        holder.until = min(holder.until, at)
        holder.holding = False
        if waited:
            answered = holder.lock.release()
            took = now() - at
            holder.history.append(f"released at {at:.3f} -> {answered} in {took * 1000:.1f} ms")
            if answered not in (True, False):
                raise WaitingBroken(f"{holder.name}: release() returned {answered!r}, not a bool")
            if took > RETURN_BOUND:
                raise WaitingBroken(f"{holder.name}: release() took {took:.3f} s, past {RETURN_BOUND} s")
        else:
            holder.lock.release_without_waiting()
            holder.history.append(f"released at {at:.3f}, not waited for")
        if holder.lock.owned():
            raise WaitingBroken(f"{holder.name}: owned() is True after release()")

    @rule(pick=st.integers(0, 3))
    def die(self, pick: int) -> None:
        """The holder's thread is gone without a release: its keys must expire."""
        holder = self._pick(self._holders(), pick)
        if holder is None:
            self._trace(f"state.die(pick={pick})  # nobody holds")
            return
        self._trace(f"state.die(pick={pick})  # {holder.name}")
        holder.holding = False
        holder.history.append(f"abandoned at {now():.3f}, until {holder.until:.3f}")

    @rule(pick=st.integers(0, 3), ttl=st.sampled_from(TTLS))
    def extend(self, pick: int, ttl: float) -> None:
        holder = self._pick(self._holders(), pick)
        if holder is None:
            self._trace(f"state.extend(pick={pick}, ttl={ttl})  # nobody holds")
            return
        self._trace(f"state.extend(pick={pick}, ttl={ttl})  # {holder.name}")
        started = now()
        try:
            extended = holder.lock.extend(ttl)
        except OUR_ERRORS as exc:
            raise WaitingBroken(f"{holder.name}: extend({ttl}) raised {exc!r}") from exc
        took = now() - started
        # The hold ends where the lock now says: later after a success, and perhaps sooner after
        # a failure (the TTL is replaced even when the quorum is not reached: at most what the
        # new TTL allows from the round's start, which came after ``started``).
        if holder.lock.owned():
            holder.until = now() + holder.lock.validity
        else:
            holder.until = min(holder.until, started + ttl - holder.lock.redlock.drift(ttl))
        holder.history.append(
            f"extend({ttl}) -> {extended} in {took * 1000:.1f} ms, until {holder.until:.3f}"
        )
        if took > REQUEST_TIMEOUT + SLACK:
            raise WaitingBroken(f"{holder.name}: extend took {took:.3f} s")

    @rule(pick=st.integers(0, 3))
    def cancel(self, pick: int) -> None:
        waiter = self._pick([w for w in self._pending() if w.mode != "zero" and not w.cancel.is_set()], pick)
        if waiter is None:
            self._trace(f"state.cancel(pick={pick})  # nobody waits")
            return
        self._trace(f"state.cancel(pick={pick})  # {waiter.name}")
        waiter.cancelled_at = now()
        waiter.cancel.set()

    @rule(seconds=st.sampled_from([0.2, 0.05, 0.5, 1.0]))
    def sleep(self, seconds: float) -> None:
        self._trace(f"state.sleep(seconds={seconds})")
        time.sleep(seconds)

    # -- nemeses ---------------------------------------------------------------------------------------
    @rule(kind=st.sampled_from(["kill_pubsub", "kill_pubsub_everywhere", "swallow_pubsub"]), m=masters)
    def pubsub_fault(self, kind: str, m: int) -> None:
        """kill_pubsub: master m closes every listening connection (``_everywhere``: every master
        does); swallow_pubsub: m's proxy drops what the master sends on listening connections."""
        self._trace(f"state.pubsub_fault(kind={kind!r}, m={m})")
        if kind == "swallow_pubsub":
            self.proxies.swallowers[m].swallow_pubsub()
            self.swallowed.add(m)
            return
        for i in range(MASTERS) if kind == "kill_pubsub_everywhere" else [m]:
            if self.fault.get(i) == "sigstop":
                continue
            admin = self.servers[i].client()
            try:
                admin.client_kill_filter(_type="pubsub")
            finally:
                admin.close()

    @rule(kind=st.sampled_from(["sigstop", "proxy_pause"]), m=masters)
    def pause(self, kind: str, m: int) -> None:
        """Master m stops answering (SIGSTOP), or its proxy holds every byte; skipped when
        MAX_IMPAIRED masters are already."""
        skip = m in self.fault or len(self.fault) >= MAX_IMPAIRED
        self._trace(f"state.pause(kind={kind!r}, m={m})" + ("  # skipped" if skip else ""))
        if skip:
            return
        self.fault[m] = kind  # first: the monitor must not read a master that is stopping
        if kind == "sigstop":
            self.servers[m].pause()
        else:
            self.proxies[m].blackhole()

    @precondition(lambda self: bool(self.fault or self.swallowed))
    @rule(pick=masters)
    def heal(self, pick: int) -> None:
        faulty = sorted(set(self.fault) | self.swallowed)
        m = faulty[pick % len(faulty)]
        self._trace(f"state.heal(pick={pick})  # m{m}")
        self._heal(m)

    def _heal(self, m: int) -> None:
        kind = self.fault.get(m)
        if kind == "sigstop":
            self.servers[m].resume()
        self.proxies[m].heal()
        self.swallowed.discard(m)
        if kind is not None:
            self.healed_at[m] = now()
            del self.fault[m]

    # -- invariants ------------------------------------------------------------------------------------
    @invariant()
    def exclusion(self) -> None:
        holds = [
            Hold(RESOURCE, w.returned, w.until, owner=w.name, info=w)
            for w in self.waiters
            if w.result and w.returned is not None
        ]
        overlaps = find_overlaps(holds)
        if overlaps:
            details = "; ".join(
                self._describe(o.first.info) + " | " + self._describe(o.second.info) for o in overlaps
            )
            raise WaitingBroken(
                f"holds overlap: {[str(o) for o in overlaps]}; faults {self._faults()}; {details}"
            )
        for w in self.waiters:
            if w.result and w.validity_at_return <= 0:
                raise WaitingBroken(f"{w.name}: acquire returned True, validity {w.validity_at_return}")

    @invariant()
    def returns_in_time(self) -> None:
        t = now()
        for w in self.waiters:
            if w.error is not None:
                raise WaitingBroken(f"{w.name}: acquire raised {w.error!r}")
            returned = w.returned if w.returned is not None else t
            # What the machine stalled this process for (a loaded CI host, the proxies' own
            # threads holding the GIL) is not the library's delay.
            if returned > w.bound() + STALLS.stalled(w.started, returned):
                state = "returned" if w.returned is not None else "has not returned"
                raise WaitingBroken(
                    f"{w.name} {state} {returned - w.started:.3f} s after it began, past its bound "
                    f"of {w.bound() - w.started:.3f} s plus {STALLS.stalled(w.started, returned):.3f} s "
                    f"of measured stall (timeout {w.timeout}, cancelled at "
                    f"{w.cancelled_at}); faults {self._faults()}; {self._describe(w)}"
                )

    @invariant()
    def woken_while_free(self) -> None:
        if self.violations:
            raise WaitingBroken("liveness: " + "\n".join(self.violations))

    @invariant()
    def one_listener_per_master(self) -> None:
        deadline = now() + LISTENER_SETTLE
        while True:
            extra = self._extra_listeners()
            if not extra or now() > deadline:
                break
            time.sleep(0.05)
        if extra:
            raise WaitingBroken(
                f"more than one listening connection per master and Redlock, {LISTENER_SETTLE} s "
                f"on: {extra}; faults {self._faults()}"
            )

    def _extra_listeners(self) -> dict[str, list[str]]:
        extra: dict[str, list[str]] = {}
        for m in range(MASTERS):
            if self.fault.get(m) == "sigstop":
                continue
            try:
                listed = self._admins[m].client_list(_type="pubsub")
            except redis.RedisError:
                continue
            for name in self.names:
                mine = [f"{c['addr']} sub={c['sub']}" for c in listed if c.get("name") == name]
                if len(mine) > 1:
                    extra[f"m{m}/{name}"] = mine
        return extra

    # -- between examples ------------------------------------------------------------------------------
    def teardown(self) -> None:
        for waiter in self.waiters:
            waiter.cancel.set()
        for m in range(MASTERS):
            self._heal(m)
        for waiter in self.waiters:
            if waiter.thread is not None:
                waiter.thread.join(CANCEL_BOUND + 2)
        self._stop.set()
        self._monitor.join(2)
        for waiter in self.waiters:
            with contextlib.suppress(*OUR_ERRORS):
                waiter.lock.release()
        for client in self.clients:
            client.close()
        deadline = time.monotonic() + 2.0
        while self.proxies.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        for admin in self._admins:
            admin.flushall()
            admin.close()
        counts = {
            "examples": 1,
            "waiters": len(self.waiters),
            "acquired": sum(1 for w in self.waiters if w.result),
            "monitor samples": self.monitor_samples,
            "free samples": self.free_seen,
        }
        note(f"exercised: {counts}")
        STATS.update(counts)


# What the runs exercised, printed after each: a green run that never waited proves nothing.
STATS: collections.Counter[str] = collections.Counter()
# Scheduling stalls of this process, discounted from the timing bounds (testing/stalls.py).
STALLS = StallMeter(clock=now)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[ServerSet, SwallowingProxySet]]:
    """Five masters of our own (SIGSTOP must not leak into other tests) behind swallowing proxies."""
    with ServerSet(MASTERS) as servers:
        proxies = SwallowingProxySet([s.address for s in servers], name="waiting")
        with proxies:
            yield servers, proxies


@pytest.mark.timeout(TIMEOUT)
def test_waiting_machine(
    cluster: tuple[ServerSet, SwallowingProxySet], monkeypatch: pytest.MonkeyPatch
) -> None:
    servers, proxies = cluster
    WaitingMachine.servers = servers
    WaitingMachine.proxies = proxies
    # Hypothesis documents this knob for this: shrinking ends inside the pytest timeout.
    monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS)
    # The subscriber's timers, shortened so an example sees them fire: rooms linger out and are
    # unsubscribed, the thread exits when idle and a later wait starts it again, and a link that
    # is paused, held or swallowed misses its pong and is reconnected.
    for name, seconds in SUBSCRIBER_TIMERS.items():
        monkeypatch.setattr(subscriber_module, name, seconds)
    seed_value = int(SEED) if SEED else random.SystemRandom().getrandbits(64)
    print(f"\nREDLOCK_WAITING_SEED={seed_value} (examples={EXAMPLES}, steps={STEPS})", flush=True)
    started = time.monotonic()
    STATS.clear()
    STALLS.start()
    try:
        # hypothesis.stateful ships without annotations for this function.
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            seed(seed_value)(WaitingMachine),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=STEPS,
                # Real servers and sleeps: a step's duration says nothing about the library.
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=False,
                print_blob=True,
            ),
        )
    finally:
        STALLS.stop()
        print(f"{time.monotonic() - started:.1f} s; {STATS}")
