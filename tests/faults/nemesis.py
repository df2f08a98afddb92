"""The faults, one at a time or two at once, on a schedule drawn from the seed.

Every fault takes its victims (master indexes) from the scheduler, which keeps them a minority:
each client group always reaches a majority of healthy masters, unless a scenario picks its
victims on purpose. Fault durations are waits on the stop event, so a run ends promptly.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery_redlock.testing.servers import process_state

from .client import STALE_THREAD_TTLS
from .cluster import MASTERS, Cluster
from .register import EVENTS, Register

T = TypeVar("T")


@dataclass
class Nemesis:
    cluster: Cluster
    register: Register
    rng: random.Random
    ttl: float
    stop: threading.Event = field(default_factory=threading.Event)
    pids: dict[str, int] = field(default_factory=dict)  # process clients, by name
    workers: list[Any] = field(default_factory=list)  # CeleryWorker processes
    # The stale-writer nemesis's targets, taken in turn: (thread|process, plain|fenced).
    stale_targets: list[tuple[str, str]] = field(default_factory=list)
    _stale_turn: int = 0
    log: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _mutex: threading.Lock = field(default_factory=threading.Lock)

    def note(self, kind: str, message: str) -> None:
        with self._mutex:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.log.append(f"{time.monotonic():.3f} {kind}: {message}")

    # -- masters ----------------------------------------------------------------------------------
    def kill_delayed(self, victims: Sequence[int]) -> None:
        """Kill, keep out for longer than the TTL, restart empty: the operator rule that makes a
        master without persistence safe."""
        for index in victims:
            self.cluster.masters[index].kill()
        self.note("kill, delayed restart", f"masters {list(victims)}")
        self.stop.wait(self.ttl * 1.5)
        for index in victims:
            self.cluster.masters[index].restart(keep_data=False)

    def kill_fsync(self, victims: Sequence[int]) -> None:
        """Kill and restart at once with the append-only file (``appendfsync always``) kept."""
        for index in victims:
            self.cluster.masters[index].kill()
            self.cluster.masters[index].restart(keep_data=True)
        self.note("kill, restart with fsynced data", f"masters {list(victims)}")

    def kill_empty(self, victims: Sequence[int]) -> None:
        """Kill and restart at once without data: outside the algorithm's assumptions."""
        for index in victims:
            self.cluster.masters[index].restart(keep_data=False)
        self.note("kill, restart empty at once", f"masters {list(victims)}")

    def pause_master(self, victims: Sequence[int]) -> None:
        """SIGSTOP longer than the TTL, then SIGCONT."""
        for index in victims:
            self.cluster.masters[index].pause()
        self.note("pause master", f"masters {list(victims)}")
        self.stop.wait(self.ttl * 1.5)
        for index in victims:
            self.cluster.masters[index].resume()

    def kill_pubsub(self, victims: Sequence[int]) -> None:
        """Drop every pub/sub connection of the victims (``CLIENT KILL TYPE pubsub``): waiters
        lose the notices in flight and must resubscribe."""
        for index in victims:
            server = self.cluster.masters[index]
            if not server.running or server.paused:
                continue
            client = server.client(socket_timeout=2)
            try:
                client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            except Exception:  # a master the nemesis itself stopped a moment ago
                pass
            finally:
                client.close()
        self.note("kill pubsub connections", f"masters {list(victims)}")
        self.stop.wait(self.ttl * 0.5)

    # -- network ------------------------------------------------------------------------------------
    def partition(self, victims: Sequence[int]) -> None:
        """For each client group, its own faults on the victims' proxies (drop, delay, black-hole
        or cut), so the groups see different majorities; then heal."""
        if not self.cluster.proxy_sets:
            raise RuntimeError("the partition nemesis needs a cluster with proxies")
        touched = []
        for group, proxies in enumerate(self.cluster.proxy_sets):
            fixed = self.cluster.spec.cut_from.get(group, ())
            # Each group loses its own subset of the victims: different groups, different views.
            mine = [i for i in victims if i not in fixed and self.rng.random() < 0.75]
            for index in mine:
                fault = self.rng.choice(["blackhole", "drop", "delay", "cut"])
                if fault == "delay":
                    seconds = round(self.rng.uniform(0.01, 0.08), 3)
                    proxies[index].delay(seconds, self.rng.choice(["up", "down", "both"]))
                    fault = f"delay {seconds}s"
                else:
                    getattr(proxies[index], fault)()
                touched.append((proxies[index], f"g{group}/m{index} {fault}"))
        self.note("partition", ", ".join(label for _, label in touched) or "nothing")
        self.stop.wait(self.rng.uniform(0.5, 2.0) * self.ttl)
        for proxy, _ in touched:
            proxy.heal()

    # -- clients ------------------------------------------------------------------------------------
    def client_pause(self, victims: Sequence[int] = ()) -> None:
        """Have the next process client that acquires a lock SIGSTOP itself before it touches the
        register; resume it once another client has written that resource."""
        if not self.pids:
            raise RuntimeError("the client-pause nemesis needs process clients")
        seen = self.register.count(EVENTS)
        self.register.request_pause()
        paused = self._wait_for(lambda: self._new_event(seen, "paused"), 5 * self.ttl)
        if paused is None:
            self.register.take_pause_request()
            self.note("client pause", "no process client acquired in time; skipped")
            return
        pid = int(paused["pid"])
        if self._wait_for(lambda: _stopped(pid) or None, 5.0) is None:
            raise RuntimeError(f"client {paused['client']} (pid {pid}) did not stop")
        self._resume_after_takeover(pid, paused, "client pause")
        self._wait_for(lambda: self._new_event(seen, "resumed"), 10.0)

    def stale_writer(self, victims: Sequence[int] = ()) -> None:
        """Have the next holder of the kind whose turn it is (thread or process client, plain or
        fenced resource) pause after its last ensure() and before its write, until another client
        has taken the lock and written the resource; then it writes without another ensure().
        A process SIGSTOPs itself and is resumed here; a thread keeps away on its own."""
        if not self.stale_targets:
            raise RuntimeError("the stale-writer nemesis needs stale_targets")
        kind, resources = self.stale_targets[self._stale_turn % len(self.stale_targets)]
        self._stale_turn += 1
        seen = self.register.count(EVENTS)
        self.register.request_stale_write(kind, resources)
        paused = self._wait_for(lambda: self._new_event(seen, "stale-paused"), 5 * self.ttl)
        if paused is None and self.register.take_stale_request(kind, resources):
            self.note("stale writer", f"no {kind} client held a {resources} resource in time; skipped")
            return
        if paused is None:  # taken just as we gave up: the holder is pausing now
            paused = self._wait_for(lambda: self._new_event(seen, "stale-paused"), 5.0)
            if paused is None:
                raise RuntimeError(f"a {kind} client took the stale-writer request and never paused")
        if paused["process"]:
            pid = int(paused["pid"])
            if self._wait_for(lambda: _stopped(pid) or None, 5.0) is None:
                raise RuntimeError(f"client {paused['client']} (pid {pid}) did not stop")
            self._resume_after_takeover(pid, paused, f"stale writer ({kind}, {resources})")
        else:
            self.note(f"stale writer ({kind}, {resources})", f"{paused['client']} held {paused['resource']}")
        self._wait_for(
            lambda: self._new_event(seen, "stale-write", lambda e: e["token"] == paused["token"]),
            (STALE_THREAD_TTLS + 2) * self.ttl + 5.0,
        )

    def _resume_after_takeover(self, pid: int, holder: dict[str, Any], what: str) -> None:
        """SIGCONT a stopped holder once another has written its resource (or 10 TTLs passed),
        so it resumes into a lock it no longer holds."""
        resource = holder["resource"]
        start_length = self.register.log_length(resource)
        taken = self._wait_for(
            lambda: self.register.log_length(resource) > start_length or None, 10 * self.ttl
        )
        os.kill(pid, signal.SIGCONT)
        self.note(
            what,
            f"{holder['client']} held {resource}; "
            f"{'taken by another' if taken else 'NOT taken by another'} before SIGCONT",
        )

    def pause_worker_child(self, victims: Sequence[int] = ()) -> None:
        """SIGSTOP a Celery worker child while its task holds a lock (before the task writes),
        and SIGCONT it once another execution has written that resource."""
        children = {pid for worker in self.workers for pid in worker.child_pids()}
        seen = self.register.count(EVENTS)
        holding = self._wait_for(
            lambda: self._new_event(seen, "holding", lambda e: e["pid"] in children), 5 * self.ttl
        )
        if holding is None:
            self.note("worker child pause", "no task held a lock in time; skipped")
            return
        pid = int(holding["pid"])
        os.kill(pid, signal.SIGSTOP)
        self.register.record({**holding, "kind": "paused", "t": time.monotonic()}, key=EVENTS)
        if self._wait_for(lambda: _stopped(pid) or None, 5.0) is None:
            os.kill(pid, signal.SIGCONT)
            raise RuntimeError(f"worker child {pid} did not stop")
        self._resume_after_takeover(pid, holding, "worker child pause")
        self._wait_for(
            lambda: self._new_event(seen, "checked", lambda e: e["token"] == holding["token"]), 10.0
        )

    def _new_event(
        self, seen: int, kind: str, match: Callable[[dict[str, Any]], bool] = lambda e: True
    ) -> dict[str, Any] | None:
        for event in self.register.records(EVENTS, seen):
            if event["kind"] == kind and match(event):
                return event
        return None

    def _wait_for(self, probe: Callable[[], T | None], timeout: float) -> T | None:
        """Poll ``probe`` until it returns something truthy, or None at the deadline."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = probe()
            if result:
                return result
            time.sleep(0.01)
        return None

    # -- the schedule -------------------------------------------------------------------------------
    def run(
        self,
        kinds: Sequence[str],
        until: float,
        *,
        victims: Sequence[int] | None = None,
        concurrent: bool = False,
        quiet: tuple[float, float] = (0.3, 1.0),
    ) -> None:
        """Until ``until``: a quiet spell, then one fault (or, with ``concurrent``, sometimes two
        different ones on two different victims at once)."""
        try:
            while not self.stop.is_set():
                self.stop.wait(self.rng.uniform(*quiet) * self.ttl)
                if self.stop.is_set() or time.monotonic() > until - 2 * self.ttl:
                    break
                chosen = (
                    list(victims)
                    if victims is not None
                    else self.rng.sample(range(MASTERS), self.rng.choice([1, 2]))
                )
                if concurrent and len(chosen) == 2 and len(kinds) > 1 and self.rng.random() < 0.5:
                    first, second = self.rng.sample(list(kinds), 2)
                    threads = [
                        threading.Thread(target=getattr(self, first), args=([chosen[0]],)),
                        threading.Thread(target=getattr(self, second), args=([chosen[1]],)),
                    ]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                else:
                    getattr(self, self.rng.choice(list(kinds)))(chosen)
        finally:
            self.cluster.heal()


def _stopped(pid: int) -> bool:
    return process_state(pid) == "T"
