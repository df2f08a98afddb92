"""One lock operation's fan-out to the masters: :class:`Round`."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from ...errors import ConfigError
from .. import wire
from .batch import await_batch
from .commands import (
    COMMON_OK,
    LATE,
    NOSCRIPT,
    NOT_AWAITED,
    NOT_SENT,
    QUEUED_BEHIND_LATE,
    REPLY_ERROR,
    SHORT_OUTCOMES,
    Command,
    Outcome,
    eval_form,
    pack_command,
)
from .handshake import NOT_REDIS
from .identity import identify
from .link import IO_ERRORS, NOT_READY, RECV_SIZE, Link
from .linkset import LinkSet, checked, settle, sleep_on
from .master import STILL_TRYING, Master

logger = logging.getLogger("celery_redlock.masters")


# The connects a round's first command waits for: (master index, its connect, or None if none
# could be begun).
Pending = list[tuple[int, Future[Link] | None]]


class Round:
    """One link per master for the span of one lock operation; a context manager.

    ``call`` sends one command per master and waits for the replies; further calls in the same
    round reuse the same links, which is what orders a release after a late acquire.
    """

    # Set only by _find_links, when some master had no idle link: the usual round reads these
    # class defaults (one attribute read per command, and one at close).
    _slow = False
    _pending: Pending | None = None
    _refusal = ""

    _unclean = False  # a link went late: the round's links go back one by one (see close)
    _deadline = 0.0  # the call under way's: a script resent after NOSCRIPT is written by it
    _noscript = False  # a batch's reply was NOSCRIPT: see batch.await_batch
    # A call under way. Left True only by an exception that cut a call short (a time limit's
    # SoftTimeLimitExceeded, KeyboardInterrupt, a green pool's Timeout, all raised wherever the
    # code happens to be): see close.
    _busy = False

    def __init__(self, masters: Sequence[Master], sets: list[LinkSet] | None = None) -> None:
        self.masters = masters
        self._sets = sets
        linkset = None
        if sets:
            try:
                linkset = sets.pop()  # atomic: no mutex
            except IndexError:
                pass  # another thread took the last one
            else:
                if not linkset.trusted():
                    linkset.unpark(masters)
                    linkset = None
        # INVARIANT: while ``_linkset`` is not None, ``links`` are exactly its links (so the set's
        # poll object watches them, and the set is parked again as it is); a round that replaces
        # or drops a link lets go of the set first.
        self._linkset = linkset
        links: list[Link | None]
        if linkset is not None:
            links = list(linkset.links)
            events = linkset.poller.poll(0)
            if events and settle(masters, links, linkset.fds, events):
                self._linkset = None
        else:
            links = checked(masters, [master.take_idle() for master in masters])
        self.links = links
        self.failures: list[str] = [""] * len(masters)
        if self._linkset is None and None in links:  # a parked set has a link for every master
            self._find_links()

    def _find_links(self) -> None:
        """Links for the masters whose idle stack had none (off the usual path): a fresh link if
        one is there, else a connect begun now, which the round's first command waits for by its
        own deadline. A master that is down or refused gets none: its vote is ``error`` at once.
        """
        pending: list[tuple[int, Future[Link] | None]] = []
        for i, master in enumerate(self.masters):
            if self.links[i] is not None:
                continue
            if master.refusal:
                self._refusal = self.failures[i] = master.refusal
                continue
            link = master.take_fresh()
            if link is not None:
                if self._identify(i, link):
                    self.links[i] = link
                continue
            why = master.unavailable()
            if why:
                self.failures[i] = why
            else:
                pending.append((i, master.start_connect()))
        if pending:
            self._pending = pending
        self._slow = bool(pending or self._refusal)

    def _identify(self, i: int, link: Link) -> bool:
        """Whether master i's new link may carry anything: its server is no other master's (see
        :func:`.identity.identify`). Every new link passes here before its first command."""
        reason = identify(self.masters, i, link)
        if reason:
            self._refusal = self.failures[i] = reason
        return not reason

    def _take_pending(self, *, voting: bool) -> Pending | None:
        """At the round's first command (slow path): refuse to count votes if a master turned
        out to be another's server, and hand over the connects to finish for this command."""
        self._slow, self._waits_from = False, time.monotonic()  # see _arrivals
        pending, self._pending = self._pending, None
        if voting and self._refusal:
            self._abandon(pending or [])
            raise ConfigError(self._refusal)
        return pending

    def _connected(
        self,
        connecting: Pending,
        commands: Sequence[Command | None],
        deadline: float,
        outcomes: list[Outcome],
        *,
        waited: bool,
    ) -> list[int]:
        """Send ``commands[i]`` to each master whose connect ends
        by ``deadline``, as soon as it does; the masters a command went to (slow path: their
        replies are read after every other master's, by the same deadline)."""
        sent = []
        tried: set[int] = set()  # got a link in time (a failed write is kept where it fails)
        for i in self._arrivals(connecting, deadline):
            tried.add(i)
            command = commands[i]
            if command is None:
                continue
            link = self.links[i]
            assert link is not None
            try:
                link.send(pack_command(command), deadline)
            except IO_ERRORS as exc:
                self._unsent(i, command, exc, outcomes, waited)
                continue
            sent.append(i)
        for i, _ in connecting:
            command = commands[i]
            if self.links[i] is None and i not in tried and command is not None:
                # Failed, refused, or still connecting at the deadline (its link, when it comes,
                # is a new link and writes what is kept first).
                self._unsent(i, command, None, outcomes, waited)
        return sent

    def _arrivals(self, pending: Pending, deadline: float) -> Iterator[int]:
        """Each master of ``pending`` as its new link is ready and identified, by ``deadline``.
        A connect still under way then goes on, and its link is kept for a later round."""
        waiting: dict[Future[Link], int] = {}
        try:
            for i, future in pending:
                if future is not None:
                    waiting[future] = i
                    continue
                try:  # no connector thread (the interpreter is exiting): connect here
                    link = self.masters[i].connect(deadline)
                except RedisConnectionError as exc:
                    self.failures[i] = str(exc)
                    continue
                if self._identify(i, link):
                    self.links[i] = link
                    yield i
            while waiting:
                done, _ = wait(waiting, max(0.0, deadline - time.monotonic()), FIRST_COMPLETED)
                if not done:
                    break
                for future in done:
                    i = waiting.pop(future)
                    try:
                        link = future.result()
                    except Exception as exc:  # ConnectionError; anything else is a bug, and no link
                        self.failures[i] = str(exc) or type(exc).__name__
                        continue
                    if self._identify(i, link):
                        self.links[i] = link
                        yield i
        finally:
            why = f"not connected within {time.monotonic() - self._waits_from:.2f} s, the round's deadline"
            for i in waiting.values():
                self.failures[i] = f"{why}{STILL_TRYING}"
            self._abandon([(i, future) for future, i in waiting.items()])

    def _abandon(self, pending: Pending) -> None:
        for i, future in pending:
            if future is not None:
                future.add_done_callback(self.masters[i].keep_for_later)

    def _refused(self) -> Outcome:
        """Every outcome of a call that found two masters to be one server: none of it counts."""
        return Outcome("error", detail=self._refusal)

    def _drop(self, index: int, exc: BaseException) -> Outcome:
        link = self.links[index]
        if link is not None:
            link.close()
        self._linkset = None  # see __init__
        self.links[index] = None
        self.failures[index] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, wire.ProtocolError):  # what came back is not RESP at all
            self.masters[index].refused("is not a Redis server", self.failures[index], kind=NOT_REDIS)
        return Outcome("error", detail=self.failures[index])

    def call(
        self,
        commands: Sequence[Command | None],
        timeout: float,
        *,
        keep: bool = False,
        enough: int = 0,
    ) -> list[Outcome]:
        """Send ``commands[i]`` to master i (None: skip it) and read the replies by one deadline.

        A link with a late reply gets the command too, queued behind the late one, but is not
        waited for again: its outcome is ``timeout``. ``keep``: a command that could not be
        written to a master (no link yet, a failed write) is kept and written on its next link,
        as :meth:`send` does; for a release, which must reach every master in the end even when
        its caller stops waiting for the replies. ``enough``: return once that many masters
        answered ``ok`` (a release that took effect on a quorum); the replies still to come are
        owed, read and skipped by each link's next use, as a sent command's are, and their
        outcomes say so. A slow master then costs such a call nothing.
        """
        self._deadline = deadline = time.monotonic() + timeout
        # The bound: all this call does ends by ``deadline``, connects included. Connects (and
        # name resolution, which has no timeout) run on connector threads and are waited for
        # until then at most; everything else here is non-blocking or waits on a link's poll.
        self._busy = True  # until the last reply is read: see close
        connecting = self._take_pending(voting=True) if self._slow else None
        outcomes: list[Outcome] = [NOT_SENT] * len(commands)
        waiting: list[int] = []
        for i, link in self._send(commands, deadline, outcomes, waited=not keep, connecting=connecting):
            if link.late:
                link.owed += 1
                outcomes[i] = QUEUED_BEHIND_LATE
            else:
                waiting.append(i)
        # The replies are taken in order, waiting only on the link at hand: while we sleep on
        # one master, the others' replies pile up in their sockets and are then read without
        # waiting. A round usually sleeps once or twice, where a poll over every link would
        # wake for each reply as it lands. A master that does not answer costs the remaining
        # time once; every link after it is read without waiting.
        if enough:
            self._await_enough(waiting, commands, deadline, enough, outcomes)
        elif waiting:
            # The first master has had no time to answer yet: sleep on it before the first read.
            # The others' replies have usually arrived by then, and are read without waiting.
            first = self.links[waiting[0]]
            assert first is not None
            first.poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            for i in waiting:
                outcome = self._read(i, commands[i])
                outcomes[i] = self._await(i, commands[i], deadline, False) if outcome is None else outcome
        if connecting is not None:
            for i in self._connected(connecting, commands, deadline, outcomes, waited=not keep):
                outcomes[i] = self._await(i, commands[i], deadline, read_first=False)
            if self._refusal:
                self._busy = False
                return [self._refused()] * len(outcomes)
        self._busy = False
        return outcomes

    def call_many(self, batches: Sequence[Sequence[Command]], timeout: float) -> list[list[Outcome]]:
        """Send every command of ``batches[i]`` to master i in one write (pipelined), then read
        their replies in order, all by one deadline: ``[i][j]`` is the outcome of master i's j-th.

        A batch of n commands costs each master one round trip, not n. The general form of
        :meth:`call` (which is this with one command each, kept apart as the usual round's fast
        path). A master whose j-th reply misses the deadline owes it and every later one (late),
        and their outcomes are ``timeout``; an empty batch skips that master.
        """
        deadline = time.monotonic() + timeout
        self._busy = True  # until the last reply is read: see close
        connecting = self._take_pending(voting=True) if self._slow else None
        # A batch's commands go out as one piece of bytes, packed once however many masters
        # share the batch (the heartbeat sends every master the same one).
        joined: list[Command | None] = []
        last: Sequence[Command] | None = None
        packed: bytes | None = None
        for batch in batches:
            if batch is not last:
                packed = b"".join(map(pack_command, batch)) if batch else None
                last = batch
            joined.append(packed)
        firsts: list[Outcome] = [NOT_SENT] * len(batches)
        sent = self._send(joined, deadline, firsts, waited=True, connecting=connecting)
        # Not sent (no link, or the write failed): every command of the batch shares that error.
        results = [[firsts[i]] * len(batch) for i, batch in enumerate(batches)]
        waiting: list[int] = []
        for i, link in sent:
            # _send counted one owed reply per "command"; a batch owes one per command in it.
            if link.late:
                link.owed += len(batches[i])
                results[i] = [QUEUED_BEHIND_LATE] * len(batches[i])
            else:
                waiting.append(i)
        for position, i in enumerate(waiting):
            results[i] = await_batch(self, i, batches[i], deadline, read_first=position > 0)
        if connecting is not None:
            for i in self._connected(connecting, joined, deadline, firsts, waited=True):
                results[i] = await_batch(self, i, batches[i], deadline, read_first=False)
            for i, _ in connecting:
                if self.links[i] is None:
                    results[i] = [firsts[i]] * len(batches[i])
            if self._refusal:
                self._busy = False
                return [[self._refused()] * len(batch) for batch in batches]
        self._busy = False
        return results

    def send(self, commands: Sequence[Command | None], timeout: float) -> None:
        """Send ``commands[i]`` to master i and do not wait: each link owes the reply.

        For a release: the master applies it on arrival, and the link's next use skips the reply.
        """
        deadline = time.monotonic() + timeout
        self._busy = True  # until every link has counted what it owes: see close
        connecting = self._take_pending(voting=False) if self._slow else None
        outcomes: list[Outcome] = [NOT_SENT] * len(commands)
        for _, link in self._send(commands, deadline, outcomes, waited=False, connecting=connecting):
            link.owed += 1
        if connecting is not None:
            for i in self._connected(connecting, commands, deadline, outcomes, waited=False):
                new_link = self.links[i]
                assert new_link is not None
                new_link.owed += 1
        self._busy = False

    def _send(
        self,
        commands: Sequence[Command | None],
        deadline: float,
        outcomes: list[Outcome],
        *,
        waited: bool,
        connecting: Pending | None = None,
    ) -> list[tuple[int, Link]]:
        """Write ``commands[i]`` on master i's link; the masters it went to. ``waited``: the
        caller reads the replies (a vote), else nobody does (a release). Masters whose connect
        is under way (``connecting``) are left to _connected."""
        sent = []
        links = self.links
        # The same command object goes to every master: pack it once, not once per master.
        last: Command | None = None
        packed = b""
        for i, command in enumerate(commands):
            if command is None:
                continue
            link = links[i]
            if link is None:
                if connecting is None or all(i != j for j, _ in connecting):
                    self._unsent(i, command, None, outcomes, waited)
                continue
            if command is not last:
                packed = pack_command(command)
                last = command
            try:
                # Link.send, inlined (once per master per round): the whole command in one call,
                # as a rule; only a full socket buffer waits, by the deadline.
                try:
                    written = link.sock.send(packed)
                except NOT_READY:
                    written = 0
                if written < len(packed):
                    link.send_rest(memoryview(packed)[written:], deadline)
            except IO_ERRORS as exc:
                self._unsent(i, command, exc, outcomes, waited)
                continue
            sent.append((i, link))
        return sent

    def _unsent(
        self,
        i: int,
        command: Command,
        exc: BaseException | None,
        outcomes: list[Outcome],
        waited: bool,
    ) -> None:
        """Master i could not be written to: it had no link (``exc`` None), or the write failed
        (its link is dropped). Its vote says why, and what nobody waits for is kept for its next
        link."""
        if exc is not None:
            outcomes[i] = self._drop(i, exc)
        else:
            outcomes[i] = Outcome("error", detail=self.failures[i] or "no connection")
        if not waited:
            # What nobody waits for is kept on the master and written on its next link (see
            # MAX_UNSENT): never dropped. A command someone waits for (a vote) is not: its round
            # has counted it as an error already.
            self.masters[i].keep_unsent(pack_command(command), 1)

    def _await(self, i: int, command: Command | None, deadline: float, read_first: bool) -> Outcome:
        """Master i's next own reply, waited for until ``deadline`` (reading first if
        ``read_first``). A reply that does not come in time is owed, and the link is late."""
        link = self.links[i]
        assert link is not None
        outcome = self._read(i, command) if read_first else None
        while outcome is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not link.poller.poll(remaining * 1000):
                outcome = self._read(i, command)  # it may have arrived as the time ran out
                if outcome is None:
                    link.owed += 1
                    link.late = True
                    self._unclean = True
                    return LATE
                return outcome
            outcome = self._read(i, command)
        return outcome

    def _await_enough(
        self,
        answering: list[int],
        commands: Sequence[Command | None],
        deadline: float,
        enough: int,
        outcomes: list[Outcome],
    ) -> None:
        """Read the replies of the masters in ``answering`` as they arrive, whichever comes first,
        until ``enough`` are ``ok`` or ``deadline``; what is still to come is owed on time (not
        late: the master has the command and answers it in order)."""
        pending = answering
        ok = sum(1 for o in outcomes if o.kind == "ok")
        shared = self._linkset  # see sleep_on; None once a link of it was replaced (see __init__)
        # No read before the first sleep: the commands were written a moment ago, and a read
        # of a reply not yet come is a failed system call and an exception per master. The poll
        # returns at once for a reply already there, and says which links to read.
        while pending and ok < enough:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            shared, ready = sleep_on([self.links[i] for i in pending], shared, remaining)
            pending, answered = self._read_arrived(pending, commands, outcomes, ready)
            ok += answered
        unanswered = NOT_AWAITED if ok >= enough else LATE  # a quorum answered, or time ran out
        for i in pending:
            link = self.links[i]
            assert link is not None
            link.owed += 1
            outcomes[i] = unanswered

    def _read_arrived(
        self,
        pending: list[int],
        commands: Sequence[Command | None],
        outcomes: list[Outcome],
        ready: set[int],
    ) -> tuple[list[int], int]:
        """Read what has arrived from the masters in ``pending`` into ``outcomes``: the masters
        still to answer, and how many of the others answered ``ok``. ``ready``: the descriptors
        a poll found readable; a link outside it is read only if bytes may wait in its own
        buffers (ours, or TLS's, which a poll cannot see)."""
        still = []
        ok = 0
        links = self.links
        for i in pending:
            link = links[i]
            if link is not None and link.fd not in ready and not link.tls and not link.reader.buffered():
                still.append(i)
                continue
            outcome = self._read(i, commands[i])
            if outcome is None:
                still.append(i)
            else:
                outcomes[i] = outcome
                ok += outcome.kind == "ok"
        return still, ok

    def _read(self, i: int, command: Command | None) -> Outcome | None:
        """Master i's next own reply to ``command`` if it has arrived in full (None: not yet).
        ``command`` None: a reply of a batch (NOSCRIPT is then its caller's to resend)."""
        link = self.links[i]
        assert link is not None
        try:
            reader = link.reader
            if reader._position < len(reader._buffer) or link.tls:  # bytes buffered, or TLS
                reply = link.read_reply()
            else:
                # The usual read, inlined (one per master per round): nothing buffered, and the
                # recv holds exactly the owed replies and this one, each one short line.
                data = link.sock.recv(RECV_SIZE)
                run = SHORT_OUTCOMES.get(data)
                if run is not None and run[0] == link.owed + 1:
                    link.owed = 0
                    link.late = False
                    return run[1]
                reply = link.take(data)
        except NOT_READY:
            return None
        except IO_ERRORS as exc:
            return self._drop(i, exc)
        if reply is wire.NOTHING:
            return None  # part of a reply, or only owed ones
        outcome = COMMON_OK.get(reply) if type(reply) is not list else None
        return outcome if outcome is not None else self._uncommon(i, reply, command)

    def _uncommon(self, i: int, reply: Any, command: Command | None) -> Outcome | None:
        """The outcome of a reply that is not one of the usual few (off the usual path); None
        if ``command`` was sent again (NOSCRIPT) and its new reply is now the one to wait for."""
        if isinstance(reply, wire.ReplyError) and reply.startswith(NOSCRIPT):
            return self._resend(i, reply, command)
        if isinstance(reply, wire.ReplyError):
            # No lock command fails on a master that serves us; one that does (NOPERM, READONLY,
            # OOM, MOVED, CLUSTERDOWN, ...) would otherwise only show as a vote that never
            # comes, so it is reported (rate-limited by Master.refused).
            self.masters[i].refused("refused a command", reply)
            return Outcome("error", detail=REPLY_ERROR + reply)
        return Outcome("ok", reply)

    def _resend(self, i: int, reply: wire.ReplyError, command: Command | None) -> Outcome | None:
        """Master i ran nothing (it lost its scripts: SCRIPT FLUSH). It is sent ``command``'s
        EVAL form on the same link by the call's deadline; the call sent it this one command, so
        the next reply is the script's own, and the caller sees that (None: wait for it)."""
        resent = eval_form(command)
        link = self.links[i]
        if resent is None or link is None:  # a batch's (see batch.await_batch), or not our script
            self._noscript = True
            return Outcome("error", detail=REPLY_ERROR + reply)
        try:
            link.send(resent, self._deadline)
        except IO_ERRORS as exc:
            return self._drop(i, exc)
        return None

    def close(self) -> None:
        if self._pending is not None:  # connects no command waited for: for later rounds
            self._abandon(self._pending)
            self._pending = None
        # Taken once: a round closed again (a with block after an explicit close) finds no
        # links and no set, and parks nothing a second time.
        links, self.links = self.links, [None] * len(self.masters)
        linkset, self._linkset = self._linkset, None
        if self._busy:
            # INVARIANT: a link carries the next command only if what it owes is exactly known.
            # A call cut short by an exception leaves links whose replies were sent for and not
            # read, or written and not yet counted as owed: reused, the next round would take an
            # old "+OK" for its own grant. They are closed. (A command the master had not read
            # yet may be lost with them: a SET, which grants nothing then, or a release, whose
            # key then expires with its TTL.)
            for link in links:
                if link is not None:
                    link.close()
            return
        if self._park(links, linkset):
            return
        for master, link in zip(self.masters, links, strict=True):
            if link is None:
                continue
            if link.late or master.refusal:
                master.give_back(link)
            else:
                master._idle.append(link)  # give_back's usual case, inlined: one per master per round

    def _park(self, links: list[Link | None], linkset: LinkSet | None) -> bool:
        """Park the usual round's links as one set (``linkset``, if the round took one and kept
        every link of it: see __init__); False if this round's links must go back one by one."""
        sets = self._sets
        if sets is None or self._unclean or self._refusal:
            return False
        if linkset is None:
            if None in links:
                return False
            linkset = LinkSet.park(self.masters, links)  # type: ignore[arg-type]
            if linkset is None:
                return False
        sets.append(linkset)
        return True

    def __enter__(self) -> Round:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
