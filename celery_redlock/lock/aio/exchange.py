"""The asyncio transport: the contract of :mod:`..transport.interface`, kept over asyncio.

An :class:`AsyncExchange` is one lock operation's access to the masters; it takes one link per
master at its first command there and uses it for all the operation's commands, so they reach
each master in order (a retraction always follows the late acquire it undoes). Every call is
bounded by one deadline, connects included: a master that has not answered by then gets a
``timeout`` outcome and costs the others nothing (every master's link is written at once, and
the replies are matched as they come, by :class:`~.link.Link`). A cancelled call is a call that
stopped waiting: its replies are read and dropped as they come, and its links owe them until
then (never handed on meanwhile).

``send`` and ``call(keep=True)`` (a release) are written at once (a write does not block); a
master with no link yet gets them on the link its connect brings, or, if none comes, they are
kept on its :class:`~.site.Site` for its next link: never lost. So ``send`` needs no ``await``,
and an operation's undo can be sent from a cancelled task.

:func:`drive` runs an operation of :mod:`..rounds` over an exchange, as ``rounds.drive`` does
over a blocking one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from ..._fork import pid
from ...errors import ConfigError
from ..rounds import Call, CallMany, Interrupted, Request, Send, Steps
from ..transport.commands import LATE, NOT_AWAITED, NOT_SENT, Command, Outcome, pack_command
from ..transport.identity import identify
from ..transport.master import Master
from .deadlines import Deadlines
from .handshake import open_link
from .link import Entry, Link, Sink
from .site import Site
from .tls import tls_contexts

T = TypeVar("T")


class Gather(Sink):
    """One call's replies: one slot per command, done when all (or ``enough`` ok ones) came."""

    __slots__ = ("enough", "future", "good", "missing", "results")

    def __init__(self, count: int, enough: int, missing: int | None = None) -> None:
        self.results: list[Outcome | None] = [None] * count
        self.missing = count if missing is None else missing  # the slots that wait for a reply
        self.enough = enough
        self.good = 0
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def put(self, slot: int, outcome: Outcome) -> None:
        if self.future.done():
            return  # late: the caller has its outcome (timeout) already
        self.results[slot] = outcome
        self.missing -= 1
        if outcome.kind == "ok":
            self.good += 1
        if not self.missing or (self.enough and self.good >= self.enough):
            self.future.set_result(None)

    def waiting(self) -> bool:
        return not self.future.done()

    def expire(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class AsyncExchange:
    """One lock operation's access to the masters (see the module docstring)."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport
        self._sites = transport.sites
        n = len(self._sites)
        self._links: list[Link | None] = [None] * n
        # A connect this exchange waits for, per master, and what waits to be written on its link.
        self._connecting: list[asyncio.Task[Link] | None] = [None] * n
        self._queued: dict[int, list[tuple[bytes, list[Entry]]]] = {}
        self._failures: dict[int, str] = {}  # why master i has no link (made when it has none)
        self._closed = False

    async def call(
        self, commands: Sequence[Command | None], timeout: float, *, keep: bool = False, enough: int = 0
    ) -> list[Outcome]:
        """``Exchange.call``: ``commands[i]`` to master i (None: not sent), one outcome each.
        The hot path of every round: one command per master, no batches built."""
        deadline = time.monotonic() + timeout
        self._check_refusal()
        gather = Gather(len(commands), enough, len(commands) - commands.count(None))
        results = gather.results
        for i, command in enumerate(commands):
            if command is None:
                results[i] = NOT_SENT
            else:
                packed = pack_command(command)
                self._write(i, packed, [Entry(gather, i, packed, keep)])
        if gather.missing and not (enough and gather.good >= enough):
            self._transport.deadlines.watch(deadline, gather)
            await gather.future
            if not gather.missing:  # every slot answered: no None left to replace
                return results  # type: ignore[return-value]
        else:
            gather.expire()  # nothing to wait for: whatever comes later is late
        late = NOT_AWAITED if enough and gather.good >= enough else LATE
        return [outcome or late for outcome in results]

    async def call_many(
        self, batches: Sequence[Sequence[Command]], timeout: float, *, keep: bool = False, enough: int = 0
    ) -> list[list[Outcome]]:
        """``Exchange.call_many``: every command of ``batches[i]`` to master i, pipelined."""
        deadline = time.monotonic() + timeout
        self._check_refusal()
        offsets = []
        total = 0
        for batch in batches:
            offsets.append(total)
            total += len(batch)
        gather = Gather(total, enough)
        for i, batch in enumerate(batches):
            if batch:
                packed = [pack_command(command) for command in batch]
                entries = [Entry(gather, offsets[i] + j, data, keep) for j, data in enumerate(packed)]
                self._write(i, b"".join(packed), entries)
        if gather.missing and not (enough and gather.good >= enough):
            self._transport.deadlines.watch(deadline, gather)
            await gather.future
        else:
            gather.expire()  # nothing to wait for: whatever comes later is late
        late = NOT_AWAITED if enough and gather.good >= enough else LATE
        results = gather.results
        return [
            [results[offsets[i] + j] or late for j in range(len(batch))] for i, batch in enumerate(batches)
        ]

    def send(self, commands: Sequence[Command | None], timeout: float) -> None:
        """Write ``commands[i]`` to master i; nobody waits (see the module docstring)."""
        for i, command in enumerate(commands):
            if command is not None:
                packed = pack_command(command)
                self._write(i, packed, [Entry(None, 0, packed, True)])

    def _write(self, i: int, data: bytes, entries: list[Entry]) -> None:
        """Write ``data`` (the packed commands of ``entries``) to master i: on its link, else
        once its connect ends, else the votes fail now and the releases are kept."""
        link = self._links[i]
        if link is None and self._connecting[i] is None:
            link = self._link(i)
        if link is not None and not link.closed:
            link.write(data, entries)
            return
        if self._connecting[i] is not None:
            self._queued.setdefault(i, []).append((data, entries))
            return
        self._sites[i].unanswered(entries, self._failures.get(i) or "no connection")

    def _link(self, i: int) -> Link | None:
        """Master i's link for this exchange: an idle one, else a connect is begun (None)."""
        site = self._sites[i]
        link = site.take()
        if link is not None:
            self._links[i] = link
            return link
        why = site.unavailable()
        if why:
            self._failures[i] = why
            return None
        task = site.connect()
        self._connecting[i] = task
        task.add_done_callback(lambda done: self._connected(i, done))
        return None

    def _connected(self, i: int, task: asyncio.Task[Link]) -> None:
        """Master i's connect ended: what waited for it is written on its link, but a vote its
        caller no longer waits for (written late, it could land after its retraction)."""
        self._connecting[i] = None
        queued = self._queued.pop(i, [])
        link = None if task.cancelled() or task.exception() is not None else task.result()
        if link is None:
            exc = None if task.cancelled() else task.exception()
            error = "cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
            self._failures[i] = why = self._sites[i].down_reason or error
            for _, entries in queued:
                self._sites[i].unanswered(entries, why)
            return
        for data, entries in queued:
            _write_wanted(link, data, entries)
        if self._closed:
            self._sites[i].give_back(link)
        else:
            self._links[i] = link

    def _check_refusal(self) -> None:
        transport = self._transport
        if asyncio.get_running_loop() is not transport.loop or transport.pid != pid():
            transport.bind_loop()
        for site in self._sites:
            if site.master.refusal:
                raise ConfigError(site.master.refusal)  # two masters found to be one server

    def close(self) -> None:
        self._closed = True
        links = self._links
        for i, link in enumerate(links):
            if link is not None:
                links[i] = None
                self._sites[i].give_back(link)

    def __enter__(self) -> AsyncExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_wanted(link: Link, data: bytes, entries: list[Entry]) -> None:
    """Write what of ``entries`` is still wanted on a link that came after its deadline."""
    wanted = [e for e in entries if e.keep or (e.sink is not None and e.sink.waiting())]
    if len(wanted) == len(entries):
        link.write(data, entries)
    elif wanted:
        link.write(b"".join(pack_command(e.command) for e in wanted if e.command is not None), wanted)


class AsyncTransport:
    """The masters over asyncio: exchanges, and a close that ends every task of ours."""

    def __init__(self, masters: Sequence[Master], request_timeout: float) -> None:
        contexts = tls_contexts(masters)  # ConfigError now, for options no link could honour
        self.masters = list(masters)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.deadlines = Deadlines()  # every call's deadline, on one timer
        self.sites = [
            Site(i, m, request_timeout, self._open, self.tasks, contexts[i]) for i, m in enumerate(masters)
        ]
        # The event loop of the first call: the links, their readers and the deadline timer are
        # its. From another loop nothing would read their replies nor expire the calls (a hang).
        self.loop: asyncio.AbstractEventLoop | None = None
        # The process that made it: a forked child let go of its links (see link.py), and its
        # copy of the loop, if it runs one, is no longer the one they belonged to.
        self.pid = pid()

    def bind_loop(self) -> None:
        """Bind to the running loop at the first call; from any other loop, or from a forked
        child, a ConfigError."""
        if self.pid != pid():
            raise ConfigError(
                f"this AsyncRedlock was made in process {self.pid}, not in this one ({pid()}, a "
                "forked child): open one AsyncRedlock in each process"
            )
        loop = asyncio.get_running_loop()
        if self.loop is not None and loop is not self.loop:
            raise ConfigError(
                "this AsyncRedlock serves the event loop it first ran in, not this one: open one "
                "AsyncRedlock per event loop (asyncio.run() makes a new loop each time)"
            )
        self.loop = loop

    def round(self) -> AsyncExchange:
        return AsyncExchange(self)

    async def _open(self, site: Site, deadline: float) -> Link:
        return await self.open(site, deadline)

    async def open(self, site: Site, deadline: float, load_scripts: bool = True) -> Link:
        """A new link to ``site``'s master by ``deadline``, handshake answered and identity
        checked (a listening link passes ``load_scripts=False``)."""
        link = await open_link(site, deadline, load_scripts)
        refusal = identify(self.masters, site.index, link)  # one server never votes twice
        if refusal:
            raise ConnectionError(refusal)
        site.master.run_id = link.run_id
        return link

    async def aclose(self) -> None:
        """Close every link and end every task of ours (connects, deliveries)."""
        self.deadlines.close()
        for site in self.sites:
            site.close()
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for site in self.sites:
            site.close()  # what a connect finished meanwhile


async def drive(
    steps: Steps[T], exchange: AsyncExchange, request: Request | None = None, *, close: bool = False
) -> T:
    """Run an operation of :mod:`..rounds` over ``exchange``; what it returns (``close``: and
    close the exchange then, as ``with exchange:`` would).

    Cancelled while a request is out, the operation is told (:class:`~..rounds.Interrupted`),
    and what it sends to undo the round in flight is written before the cancellation goes on
    (``send`` does not wait, so no second cancellation can stop it)."""
    try:
        if request is None:
            request = next(steps)
        while True:
            reply: Any = None
            try:
                # Dispatched here, not in a helper coroutine: one coroutine less per request.
                if type(request) is Call:
                    reply = await exchange.call(
                        request.commands, request.timeout, keep=request.keep, enough=request.enough
                    )
                elif type(request) is Send:
                    exchange.send(request.commands, request.timeout)
                else:
                    assert isinstance(request, CallMany)
                    reply = await exchange.call_many(request.batches, request.timeout)
            except asyncio.CancelledError:
                _undo(steps, exchange)
                raise
            try:
                request = steps.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
    finally:
        if close:
            exchange.close()


def _undo(steps: Steps[Any], exchange: AsyncExchange) -> None:
    """Throw Interrupted into ``steps`` and send what it sends before it lets it go."""
    try:
        request = steps.throw(Interrupted())
        while isinstance(request, Send):
            exchange.send(request.commands, request.timeout)
            request = steps.send(None)
    except (Interrupted, StopIteration):
        return
    steps.close()  # asked for a reply nobody can wait for now
