"""The links a clean round leaves parked, one per master, taken whole by the next round."""

from __future__ import annotations

from collections.abc import Sequence

from ..._fork import pid
from .. import waiting
from .link import WATCH, Generation, Link, pop_usable
from .master import Master


def checked(masters: Sequence[Master], links: list[Link | None]) -> list[Link | None]:
    """``links`` (idle, one per master, unchecked) with every link the master closed replaced by
    a checked idle link or None. One ``poll(0)`` for them all: no round trip, and one system call
    per round rather than one per master (see :meth:`Link.settle`)."""
    poller = waiting.poll()
    fds = []
    for link in links:
        if link is None:
            fds.append(-1)
        else:
            poller.register(link.fd, WATCH)
            fds.append(link.fd)
    events = poller.poll(0)
    if events:
        settle(masters, links, fds, events)
    return links


def sleep_on(
    pending: Sequence[Link | None], shared: LinkSet | None, remaining: float
) -> tuple[LinkSet | None, set[int]]:
    """Sleep until a link of ``pending`` may have a reply, or ``remaining`` seconds passed: (the
    set to sleep on next time, the descriptors the poll found readable or closed). The usual
    round's links are a parked set whose poll object watches them all: slept on as it is (no
    poll object made per call) until it wakes for a link already answered, and then never again
    in that call."""
    if shared is not None:
        fds = {link.fd for link in pending if link is not None}
        ready = {fd for fd, _ in shared.poller.poll(remaining * 1000)}
        if ready and ready.isdisjoint(fds):
            return None, ready  # woken by an answered link: poll the pending ones alone
        return shared, ready
    # One poll over the links still to answer (made again as they answer: a dropped link's
    # descriptor must not stay in it).
    poller = waiting.poll()
    for link in pending:
        if link is not None:
            poller.register(link.fd, WATCH)
    return None, {fd for fd, _ in poller.poll(remaining * 1000)}


def settle(
    masters: Sequence[Master], links: list[Link | None], fds: list[int], events: list[tuple[int, int]]
) -> bool:
    """Replace in ``links`` every link that ``poll`` found closed (``fds[i]`` is link i's), by
    another idle link or None; whether any was replaced."""
    replaced = False
    for fd, event in events:
        i = fds.index(fd)
        link = links[i]
        if link is not None and not link.settle(event):
            link.close()
            links[i] = pop_usable(masters[i]._idle)
            replaced = True
    return replaced


class LinkSet:
    """One idle link per master, as a round that ended cleanly left them, with one ``poll``
    object watching all of them.

    The usual round takes a whole set with one pop and checks it with one ``poll(0)``, where
    taking five links from five idle stacks, registering each with a new poll object and giving
    each back cost a loop over the masters apiece. A set holds only links a master's idle stack
    could hold (none late, none of a refused master), and is trusted whole only in the process
    and the :class:`Generation` it was parked in: a set from before a fork is dropped (its
    sockets are the parent's), and one from before a master was closed or refused is handed
    back link by link (:meth:`Master.give_back` closes a refused master's).
    """

    __slots__ = ("fds", "generation", "links", "pid", "poller")

    def __init__(self, links: list[Link]) -> None:
        self.generation = Generation.value  # read before the refusals are looked at: see park
        self.pid = pid()
        self.links = links
        self.fds = [link.fd for link in links]
        self.poller = waiting.poll()
        for fd in self.fds:
            self.poller.register(fd, WATCH)

    @classmethod
    def park(cls, masters: Sequence[Master], links: list[Link]) -> LinkSet | None:
        """A new set of ``links``, or None if one of ``masters`` is refused (its link must be
        closed, which :meth:`Master.give_back` does)."""
        linkset = cls(links)
        # A refusal sets Master.refusal before it bumps the generation: one that comes after the
        # set read the generation makes the set stale; one before is seen here.
        for master in masters:
            if master.refusal:
                return None
        return linkset

    def trusted(self) -> bool:
        return self.generation == Generation.value and self.pid == pid()

    def unpark(self, masters: Sequence[Master]) -> None:
        """Take an untrusted set apart: its links go back to their masters one by one, or, in a
        forked child, are dropped unused (never read, never shut down: they are the parent's)."""
        if self.pid != pid():
            return
        for master, link in zip(masters, self.links, strict=True):
            master.give_back(link)
