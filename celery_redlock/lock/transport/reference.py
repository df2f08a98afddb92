"""The reference transport (``transport="redis-py"``): the contract of :mod:`.interface` kept
with redis-py used plainly, to be read as correct (the core contract tests run over both). One
``ConnectionPool`` per master, from its connection class and options (``request_timeout`` for
connect and reads, no client-side retries). A *lane* is one daemon thread and one connection to
one master: an exchange's commands to a master all run on one lane, each written once the reply
before it has been read, however late, so a release never overtakes the late acquire it undoes.
The caller waits for every master by one deadline, on a Future per command: one that has not
answered by then gets the fast transport's ``timeout`` while its lane reads on. What nobody waits
for (``send``, ``call(keep=True)``) is written even so, on a new connection if one breaks: a lane
tries for ``KEEP_FOR`` request timeouts, then hands it back to its master, which queues it again
after ``RETRY_CAP`` until it is written (past ``MAX_KEPT`` per master the oldest are dropped with
a log line: the TTL bounds their keys).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import redis
from redis._parsers import _RESP2Parser
from redis.exceptions import RedisError, ResponseError

from ..._fork import let_go_of_inherited
from ...errors import ConfigError
from .commands import (
    COMMON_OK,
    LATE,
    NOSCRIPT,
    NOT_AWAITED,
    NOT_SENT,
    QUEUED_BEHIND_LATE,
    REPLY_ERROR,
    Command,
    Outcome,
    eval_form,
    is_noscript,
    script_loads,
)
from .handshake import NOT_REDIS, Unfit, check_identity
from .master import Master

logger = logging.getLogger("celery_redlock.transport.reference")

MAX_LANES = 32  # per master: the bound on this transport's threads and connections
IDLE_EXIT = 5.0  # seconds a lane may sit idle before its thread and connection end
KEEP_FOR = 5  # request timeouts: how long a kept command is retried on new connections
LATE_FOR = 30.0  # seconds a lane waits for a late reply before it drops the connection
RETRY_FLOOR, RETRY_CAP = 0.05, 0.5  # the pause between two connects for a kept command
MAX_KEPT = 1024  # per master: kept commands waiting for it to come back (the fast MAX_UNSENT)
ERRORS = (RedisError, OSError)  # what a failed connect, write or read raises
NOT_WRITTEN = Outcome("error", detail="not written within request_timeout (connecting, or behind replies)")

# redis-py 5.0 requires a command name here; 5.3 and later deprecate passing one.
_NAME = inspect.signature(redis.ConnectionPool.get_connection).parameters.get("command_name")
_GET_ARGS = ("PING",) if _NAME is not None and _NAME.default is inspect.Parameter.empty else ()


class _WholeErrors(_RESP2Parser):
    """redis-py's RESP2 parser, keeping an error's whole line: redis-py strips the codes it knows
    ("NOSCRIPT", "ERR"), and an outcome must read as the fast transport's (see fencing.py)."""

    @classmethod
    def parse_error(cls, response: str) -> Any:
        error = super().parse_error(response)
        error.line = response
        return error


def _failure(exc: BaseException) -> Outcome:
    """A failure as the fast transport words it: the server's error line, or what broke."""
    if isinstance(exc, ResponseError):
        return Outcome("error", detail=REPLY_ERROR + str(getattr(exc, "line", exc)))
    kind = "refused" if isinstance(exc, Unfit) else type(exc).__name__  # (as Master.unfit says it)
    return Outcome("error", detail=f"{kind}: {exc}")


def _resolve(future: Future[Any] | None, result: Any) -> None:
    if future is not None:
        with contextlib.suppress(InvalidStateError):  # cancelled, or answered at a first failure
            future.set_result(result)


def _written(jobs: Sequence[_Job | Outcome], deadline: float) -> None:
    """Wait until every job of ``jobs`` not queued behind a late reply is written (or failed)."""
    waiting = [job.written for job in jobs if isinstance(job, _Job) and not job.behind]
    wait(waiting, max(0.0, deadline - time.monotonic()))


@dataclass(eq=False)
class _Job:
    """Commands for one lane, written in one piece, their replies read in order."""

    commands: Sequence[Command]
    future: Future[list[Outcome]] | None  # None: nobody waits (send)
    keep: bool  # written even once its caller stopped waiting
    written: Future[None] = field(default_factory=Future)  # done once written (or failed)
    behind: bool = False  # queued behind a late reply: written when that reply has come
    replies: list[Outcome] = field(default_factory=list)  # as they are read (a batch's partial answer)

    def claim(self) -> bool:
        """Whether it may be written: not a vote its caller cancelled (never written late)."""
        future = self.future
        if future is None or future.running() or future.done():
            return future is None or not future.cancelled()
        return future.set_running_or_notify_cancel()


class _Site:
    """One master: its pool and its lanes (``_mutex`` guards the lists and the lanes' counts)."""

    def __init__(self, master: Master) -> None:
        self.master = master
        options = dict(master._options)
        options.update(redis_connect_func=self._handshake, parser_class=_WholeErrors, decode_responses=False)
        self.pool = redis.ConnectionPool(connection_class=master._connection_class, **options)
        self.lanes: list[_Lane] = []
        self.idle: list[_Lane] = []
        self.generation = 0  # close() ends the lanes of older ones once they are idle
        self.quiet_until = 0.0  # (a dead master under load drops a release per lock)
        self.kept: list[_Job] = []  # given back by a lane that could not write them (see keep)
        self.keeping = False  # a timer will queue them again
        self.closed = False  # close() stops queuing them again; the next exchange resumes it
        self._mutex = threading.Lock()

    def take(self) -> _Lane | None:
        """A lane for one exchange (None: no thread can start, the interpreter is exiting)."""
        with self._mutex:
            self.closed = False  # in use again (a Redlock stays usable after close)
            resume = bool(self.kept) and not self.keeping
            if self.idle:
                lane = self.idle.pop()
            elif len(self.lanes) < MAX_LANES:
                lane = _Lane(self)
                try:
                    lane.thread.start()
                except RuntimeError:
                    return None
                self.lanes.append(lane)
            else:  # at the bound: share the least busy one (in order all the same, only slower)
                lane = min(self.lanes, key=lambda lane: lane.pending)
            lane.users += 1
        if resume:  # kept commands that a close() stopped go out again
            self._schedule()
        return lane

    def count(self, lane: _Lane, jobs: int = 0, users: int = 0) -> None:
        """A job queued (+1) or done (-1), an exchange left (-1): idle once it owes nothing."""
        with self._mutex:
            lane.pending += jobs
            lane.users += users
            if lane.users or lane.pending or lane not in self.lanes:
                return
            if lane.generation == self.generation:
                self.idle.append(lane)
            else:
                self._stop(lane)

    def retire(self, lane: _Lane) -> None:
        with self._mutex:  # unless an exchange took it meanwhile
            if lane in self.idle:
                self.idle.remove(lane)
                self._stop(lane)

    def _stop(self, lane: _Lane) -> None:
        # Out of the lists first, under the mutex: no exchange can queue anything behind the stop.
        self.lanes.remove(lane)
        lane.jobs.put(None)

    def keep(self, job: _Job) -> None:
        """Queue ``job`` (nobody waits for it) again after RETRY_CAP, on whichever lane is free
        then, until a lane writes it.

        INVARIANT (not lost): a kept command a lane could not write is handed here, never dropped
        while its master is out (as the fast transport keeps it on the master); only past
        MAX_KEPT per master is the oldest dropped, its key then bounded by its TTL."""
        with self._mutex:
            self.kept.append(job)
            dropped = self.kept.pop(0) if len(self.kept) > MAX_KEPT else None
        if dropped is not None and (now := time.monotonic()) >= self.quiet_until:
            self.quiet_until = now + 60  # at WARNING once a minute per master
            logger.warning("dropped a kept command for %s: over %d wait for it", self.master.name, MAX_KEPT)
        self._schedule()

    def _schedule(self) -> None:
        """Queue the kept commands again after RETRY_CAP: one timer at a time, none once closed
        (a closed Redlock starts nothing more, as the fast transport's; its next exchange resumes
        them), held weakly (a Redlock dropped meanwhile ends the retries)."""
        with self._mutex:
            if self.keeping or self.closed:
                return
            self.keeping = True
        timer = threading.Timer(RETRY_CAP, _requeue, args=(weakref.ref(self),))
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # the interpreter is exiting
            self.keeping = False

    def requeue(self) -> None:
        with self._mutex:
            self.keeping = False
            if self.closed:
                return
            jobs, self.kept = self.kept, []
        lane = self.take() if jobs else None
        if lane is None:
            return
        for job in jobs:
            self.count(lane, jobs=1)
            lane.jobs.put(job)
        self.count(lane, users=-1)

    def close(self) -> None:
        with self._mutex:
            self.closed = True
            self.generation += 1
            idle, self.idle = self.idle, []
            for lane in idle:
                self._stop(lane)
        self.pool.disconnect(inuse_connections=False)  # the lanes close their own as they end

    def _handshake(self, conn: redis.Connection) -> None:
        """redis-py's own handshake (AUTH, CLIENT SETNAME, SELECT), then what the server is: a
        replica, a cluster node or a Sentinel never votes, as with the fast transport. Every
        script is loaded in the same write, as the fast transport's links do (see scripts.py:
        a master has them all before one is sent by digest)."""
        conn.on_connect()
        loads = script_loads()
        conn.send_packed_command(conn.pack_commands([("INFO", "server"), ("INFO", "replication"), *loads]))
        replies: list[Any] = [b""] * (2 + len(loads))
        for n in range(len(replies)):
            # INFO refused (renamed, an ACL): unidentified; SCRIPT LOAD refused: EVAL on NOSCRIPT
            with contextlib.suppress(ResponseError):
                replies[n] = conn.read_response()
        try:
            check_identity(*replies[:2])
        except Unfit as exc:
            self.master.unfit = f"refused: {exc}"
            self.master.refused("is refused for the life of this Redlock", str(exc), kind=NOT_REDIS)
            raise


class _Lane:
    """One thread and one connection to one master: runs its jobs strictly in order."""

    def __init__(self, site: _Site) -> None:
        self.site = site
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.conn: redis.Connection | None = None
        self.users = self.pending = 0  # exchanges holding it; jobs queued or under way
        self.generation = site.generation
        self.thread = threading.Thread(target=self._run, name=f"redlock-lane {site.master.name}", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_EXIT)
            except queue.Empty:
                self.site.retire(self)  # idle that long: it ends (its stop is queued)
                continue
            if job is None:
                break
            try:
                self._do(job)
            except BaseException:  # a bug: no caller may wait for an answer that never comes
                logger.exception("a lane to %s failed", self.site.master.name)
                self._drop()
                _resolve(job.future, [NOT_SENT] * len(job.commands))
            _resolve(job.written, None)
            self.site.count(self, jobs=-1)
        self._drop()

    def close_inherited(self) -> None:
        """In a forked child: let go of the child's copy of this lane's socket, nothing else (no
        shutdown, which would end the parent's connection too; no pool, whose lock a thread that
        is gone may hold). See ``_fork.let_go_of_inherited``."""
        conn, self.conn = self.conn, None
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            let_go_of_inherited([sock])

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.disconnect()
            self.site.pool.release(self.conn)
            self.conn = None

    def _do(self, job: _Job) -> None:
        try:  # idle, it owes nothing: anything to read (EOF above all) means the master closed it
            if self.conn is not None and self.conn.can_read(timeout=0):
                raise redis.ConnectionError("closed while idle")
        except ERRORS:  # (its timeout, a restart): a release written to it would be lost
            self._drop()
        if self._write(job):
            assert self.conn is not None
            self._read(self.conn, job)
            _resolve(job.future, job.replies)

    def _write(self, job: _Job) -> bool:
        """Write ``job`` on this lane's connection (made again if it broke); False if it ended
        otherwise: refused, claimed by nobody, a failed vote, or a kept command given up."""
        master, future, count = self.site.master, job.future, len(job.commands)
        give_up, pause = 0.0, RETRY_FLOOR
        while True:
            if why := master.refusal or master.unfit:  # refused meanwhile: nothing more goes to it
                _resolve(future, [Outcome("error", detail=why)] * count)
                return False
            try:
                if self.conn is None:
                    self.conn = self.site.pool.get_connection(*_GET_ARGS)
                if not job.claim():
                    return False
                chunks: list[bytes] = []
                for command in job.commands:  # packed once by a wire.Template, or arguments to pack
                    chunks += [command] if type(command) is bytes else self.conn.pack_command(*command)
                self.conn.send_packed_command(chunks, check_health=False)
                _resolve(job.written, None)
                return True
            except ERRORS as exc:
                self._drop()
                if not job.claim():
                    return False
                _resolve(future, [_failure(exc)] * count)
                _resolve(job.written, None)  # kept, as the fast transport keeps a failed write
                if not job.keep:
                    return False
                # A release must not vanish because a connection broke: written on a new one.
                give_up = give_up or time.monotonic() + KEEP_FOR * master._request_timeout
                if time.monotonic() + pause > give_up:  # out for a while: queued again later
                    logger.debug("kept %d command(s) for %s: %s", count, master.name, exc)
                    self.site.keep(job)
                    return False
                time.sleep(pause)
                pause = min(2 * pause, RETRY_CAP)

    def _read(self, conn: redis.Connection, job: _Job) -> None:
        """Every reply of ``job``, in order, however late (up to LATE_FOR), before anything else.

        A command answered NOSCRIPT (the master lost its scripts, and ran nothing) is sent again
        as EVAL on this connection once the job's replies are in, and its reply stands in for
        the NOSCRIPT, whether anyone waits or not: the caller sees the script's own reply, and a
        release nobody waits for still runs. From the first such reply on, the replies are held
        back from ``job.replies`` (what a caller who stops waiting takes) until it is answered.
        """
        give_up = time.monotonic() + LATE_FOR
        replies = job.replies
        missing: list[int] = []
        for j, command in enumerate(job.commands):
            try:
                outcome = self._reply(conn, give_up)
            except ERRORS as exc:
                self._drop()
                replies += [_failure(exc)] * (len(job.commands) - len(replies))
                break
            if outcome.kind == "error" and is_noscript(outcome) and eval_form(command) is not None:
                missing.append(j)
                replies = replies if replies is not job.replies else list(replies)
            replies.append(outcome)
        if missing and self.conn is not None:
            self._resend(conn, [job.commands[j] for j in missing], missing, replies, give_up)
        if replies is not job.replies:
            job.replies[:] = replies

    def _reply(self, conn: redis.Connection, give_up: float) -> Outcome:
        """The next reply on ``conn`` (an error reply as an error outcome), by ``give_up``."""
        try:
            # Waited for here, not by the socket timeout: redis-py closes a connection whose
            # read times out, and the command after it would then overtake the late one.
            while not conn.can_read(timeout=min(1.0, max(0.0, give_up - time.monotonic()))):
                if time.monotonic() >= give_up:
                    raise redis.TimeoutError(f"no reply in {LATE_FOR:g} s: connection dropped")
            reply = conn.read_response()
        except ResponseError as exc:
            line = getattr(exc, "line", str(exc))
            if not line.startswith(NOSCRIPT):  # NOSCRIPT ran nothing: see _read
                self.site.master.refused("refused a command", line)
            return _failure(exc)
        common = COMMON_OK.get(reply) if type(reply) is not list else None
        # (No lock command's reply holds an error inside an array, where redis-py would differ.)
        return common if common is not None else Outcome("ok", reply)

    def _resend(
        self,
        conn: redis.Connection,
        commands: list[Command],
        at: list[int],
        replies: list[Outcome],
        give_up: float,
    ) -> None:
        """Send ``commands`` (answered NOSCRIPT) again as EVAL, in one write, and put their
        replies in ``replies`` at ``at``."""
        try:
            conn.send_packed_command([eval_form(command) or b"" for command in commands], check_health=False)
            for j in at:
                replies[j] = self._reply(conn, give_up)
        except ERRORS as exc:
            self._drop()
            for j in at:
                replies[j] = replies[j] if not is_noscript(replies[j]) else _failure(exc)


class ReferenceExchange:
    """One lock operation: one lane per master, taken at its first command (see the module)."""

    def __init__(self, sites: Sequence[_Site]) -> None:
        self._sites = sites
        self._lanes: list[_Lane | None] = [None] * len(sites)
        # Per master, the last reply of this exchange that was late: what follows waits for it.
        self._late: list[Future[list[Outcome]] | None] = [None] * len(sites)
        self._shared = [False] * len(sites)

    def call(
        self, commands: Sequence[Command | None], timeout: float, *, keep: bool = False, enough: int = 0
    ) -> list[Outcome]:
        batches = [() if command is None else (command,) for command in commands]
        return [got[0] if got else NOT_SENT for got in self.call_many(batches, timeout, keep, enough)]

    def send(self, commands: Sequence[Command | None], timeout: float) -> None:
        # Written (by the deadline) before it returns, as by the fast transport: a release not
        # waited for is then on its way before anything this process sends next on other lanes.
        deadline = time.monotonic() + timeout
        sent = [self._submit(i, (c,), True, False) for i, c in enumerate(commands) if c is not None]
        _written(sent, deadline)

    def call_many(
        self, batches: Sequence[Sequence[Command]], timeout: float, keep: bool = False, enough: int = 0
    ) -> list[list[Outcome]]:
        deadline = time.monotonic() + timeout
        if refusal := next((site.master.refusal for site in self._sites if site.master.refusal), ""):
            raise ConfigError(refusal)  # as the fast round: two masters found to be one server
        results: list[list[Outcome]] = [[] for _ in batches]
        jobs: dict[Future[list[Outcome]], tuple[int, _Job]] = {}
        for i, batch in enumerate(batches):
            if batch:
                sent = self._submit(i, batch, keep, waited=True)
                if isinstance(sent, Outcome):
                    results[i] = [sent] * len(batch)
                elif sent.future is not None:
                    jobs[sent.future] = i, sent
        if not enough:  # every reply: each waited for in turn, by the one deadline
            for future in jobs:
                with contextlib.suppress(FutureTimeout):
                    future.exception(max(0.0, deadline - time.monotonic()))
        else:
            _await_enough(jobs, results, enough, deadline)
        self._unanswered(jobs, results, keep, enough)
        return results

    def _unanswered(
        self,
        jobs: dict[Future[list[Outcome]], tuple[int, _Job]],
        results: list[list[Outcome]],
        keep: bool,
        enough: int,
    ) -> None:
        """The outcomes of the jobs not taken by the deadline (or by ``enough``)."""
        # Those not waited for stopped being waited for on a quorum, or when time ran out.
        reached = sum(1 for got in results if got and got[0].kind == "ok") >= enough
        for future, (i, job) in jobs.items():
            count = len(job.commands)
            if (not keep and future.cancel()) or not (future.running() or future.done()):
                results[i] = [NOT_WRITTEN] * count  # a vote: now never will be; kept: once connected
            elif future.done():  # answered as the time ran out
                results[i] = future.result()
            elif enough:  # read and skipped by the lane, as the fast transport's owed replies
                results[i] = [NOT_AWAITED if reached else LATE] * count
            else:
                self._late[i] = future
                got = list(job.replies)  # a batch's replies read in time count
                results[i] = got + [LATE] * (count - len(got))

    def _submit(self, i: int, commands: Sequence[Command], keep: bool, waited: bool) -> _Job | Outcome:
        site = self._sites[i]
        if why := site.master.refusal or site.master.unfit:  # never sent to, as by the fast transport
            return Outcome("error", detail=why)
        lane = self._lanes[i]
        if lane is None:
            lane = self._lanes[i] = site.take()
            if lane is None:
                return Outcome("error", detail="no thread could be started for this master")
            # Shared at MAX_LANES, owing what ended exchanges sent (a dead master's kept releases).
            self._shared[i] = lane.pending > 0 and lane.users == 1
        late = self._late[i]
        # Behind a late reply or those: written in its turn whoever waits, and not waited for.
        behind = self._shared[i] or (late is not None and not late.done())
        job = _Job(commands, Future() if waited else None, keep or behind, behind=behind)
        site.count(lane, jobs=1)
        lane.jobs.put(job)
        return QUEUED_BEHIND_LATE if waited and behind else job

    def close(self) -> None:
        lanes, self._lanes = self._lanes, [None] * len(self._sites)
        for site, lane in zip(self._sites, lanes, strict=True):
            if lane is not None:
                site.count(lane, users=-1)

    def __enter__(self) -> ReferenceExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ReferenceTransport:
    """Exchanges over ``masters`` through redis-py pools, one thread per master per lane."""

    def __init__(self, masters: Sequence[Master]) -> None:
        self.masters = masters
        self._sites = [_Site(master) for master in masters]

    def round(self) -> ReferenceExchange:
        return ReferenceExchange(self._sites)

    def close(self) -> None:
        """End the idle lanes and their connections (busy ones once they owe nothing)."""
        for site in self._sites:
            site.close()

    def after_fork_in_child(self) -> None:
        # The parent's lanes have no thread here and their connections are the parent's: new sites,
        # new pools. The old are dropped unused: redis-py closes only the child's copy of a dropped
        # connection's socket (no shutdown in a process that did not open it). A lane's own
        # connection is never dropped, though: the lane is held by its thread's frame, which
        # CPython does not free for a thread that did not survive the fork. Its socket would keep
        # the parent's connection open on the master for as long as the child lives, the parent
        # dead or not; the child closes its copy (the parent's stays open and usable).
        old, self._sites = self._sites, [_Site(master) for master in self.masters]
        for site in old:
            for lane in list(site.lanes):  # no mutex: the threads that could hold it are gone
                lane.close_inherited()


def _requeue(site: weakref.ref[_Site]) -> None:
    found = site()
    if found is not None:
        found.requeue()


def _await_enough(
    jobs: dict[Future[list[Outcome]], tuple[int, _Job]],
    results: list[list[Outcome]],
    enough: int,
    deadline: float,
) -> None:
    """Return once ``enough`` masters answered ok, every command written (as the fast
    transport); the answered jobs leave ``jobs`` for ``results``."""
    _written([job for _, job in jobs.values()], deadline)
    while jobs and sum(r[0].kind == "ok" for r in results if r) < enough:
        if (remaining := deadline - time.monotonic()) <= 0:
            break
        for future in wait(jobs, remaining, FIRST_COMPLETED)[0]:
            results[jobs.pop(future)[0]] = future.result()
