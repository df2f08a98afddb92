"""Five real masters, a register server, and one proxy set per client group.

``cut_from`` gives each group a fixed partition: the masters that group never reaches (its
proxies reset every connection). Groups that share only one master are the layout in which the
out-of-assumption faults on that master produce an overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from celery_redlock.testing import ProxySet, RedisServer

MASTERS = 5


@dataclass(frozen=True)
class ClusterSpec:
    persistent: bool = False
    clock_rates: Mapping[int, float] = field(default_factory=dict)  # master index -> clock rate
    clock_offsets: Mapping[int, float] = field(default_factory=dict)  # master index -> seconds ahead
    groups: int = 1
    proxies: bool = False  # route clients through proxies (always, with more than one group)
    cut_from: Mapping[int, Sequence[int]] = field(default_factory=dict)  # group -> masters


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.masters = [
            RedisServer(
                persistent=spec.persistent,
                clock_rate=spec.clock_rates.get(i),
                clock_offset=spec.clock_offsets.get(i),
            )
            for i in range(MASTERS)
        ]
        self.register = RedisServer()
        self.proxy_sets: list[ProxySet] = []

    def start(self) -> Cluster:
        try:
            for server in [*self.masters, self.register]:
                server.start()
            if self.spec.proxies or self.spec.groups > 1:
                for group in range(self.spec.groups):
                    proxies = ProxySet((m.address for m in self.masters), name=f"g{group}-")
                    self.proxy_sets.append(proxies.start())
                    for index in self.spec.cut_from.get(group, ()):
                        proxies[index].cut()
        except BaseException:
            self.close()
            raise
        return self

    def urls(self, group: int) -> list[str]:
        if self.proxy_sets:
            return self.proxy_sets[group].urls
        return [m.url for m in self.masters]

    def heal(self) -> None:
        """Undo every fault except the fixed partitions: resume, start, heal the proxies."""
        for server in self.masters:
            if server.paused:
                server.resume()
            if not server.running:
                server.start()
        for group, proxies in enumerate(self.proxy_sets):
            for index, proxy in enumerate(proxies):
                if index not in self.spec.cut_from.get(group, ()):
                    proxy.heal()

    def close(self) -> None:
        for proxies in self.proxy_sets:
            with contextlib.suppress(Exception):
                proxies.close()
        for server in [*self.masters, self.register]:
            server.cleanup()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
