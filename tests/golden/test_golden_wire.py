"""Golden wire records: the commands each kind of lock sends each master, per operation.

Why: the transport (``celery_redlock/lock/masters.py`` and ``wire.py``) is to be split and put
behind an interface. Such a refactor must not change what reaches the masters. Each test here
runs one operation through a recording proxy (:mod:`tests.golden.recorder`) in front of three
real masters and compares what every master received with a file under ``data/wire/``, one
file per (kind of lock, operation).

What a file freezes, per master: every command in the order sent, with all its arguments, and
the link it went out on (``link 1`` is the Redlock's first connection to that master). A
follow-up that must travel on the same link as the command before it (a retraction behind its
SET, a release behind an unread reply) would show up if it moved to another link. The
recorder parses the bytes strictly as RESP arrays of bulk strings, so a change in framing fails
too, even though the bulk lengths are not written out.

What the files leave out, because it changes from run to run:

- runs of 16 or more lowercase hex digits (lock tokens, marker values, fair queue members, the
  health probe's key) become ``<token#n>`` (40 digits), ``<member#n>`` (24) or ``<hex#n>``,
  numbered in order of first appearance, so "the release carries the acquire's token" is
  still checked;
- an argument of 13 to 17 decimal digits (a fence, from a master's clock in microseconds)
  becomes ``<clock#n>``, numbered the same way (a fence must be the same on every master);
- in a holder record (JSON), the values of ``host``, ``pid``, ``since`` and ``proc``;
- an ``EVAL`` body (and a ``SCRIPT LOAD``'s, in a new link's handshake) becomes
  ``<script SHA1: its first line>``. ``EVALSHA`` digests stay as sent: they are derived from the
  script source.

Not frozen at all: how the commands were split into TCP writes (the proxy sees a stream),
timing, and the replies.

Updating on purpose: when a change to what is sent is intended (a new script, another
argument), run ``CELERY_REDLOCK_GOLDEN_UPDATE=1 python -m pytest tests/golden``. Each test whose
record changed rewrites its file and is reported as skipped ("rewrote ..."); the diff of
``data/wire/`` is then the review of the protocol change. A normal run never writes.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redlock import Lock, LockKindMismatch, Redlock
from celery_redlock.lock import admin, markers
from celery_redlock.lock.holder import HolderRecord, process_identity
from celery_redlock.testing import RedisServer, ServerSet
from tests.golden.recorder import Recorder

DATA = Path(__file__).parent / "data" / "wire"
UPDATE = os.environ.get("CELERY_REDLOCK_GOLDEN_UPDATE") == "1"

# Explicit, so that a change of a default shows here and not as a golden diff: no retry sleeps
# worth the name, polling rather than a listening link (see test_plain_acquire_waiting for that).
# These tests read what is sent, not how fast it is answered: a request timeout long enough that
# a loaded host (every command also passes the recorder) never turns a step into a retry.
SETTINGS: dict[str, Any] = {
    "ttl": 10.0,
    "request_timeout": 1.0,
    "retry_count": 2,
    "retry_delay": 0.02,
    "drift_factor": 0.01,
    "key_prefix": "golden:",
    "wait": "poll",
    "fence_retention": 86400.0,
}
# The user the handshake test authenticates as (set on the test servers only).
USER, PASSWORD = "golden", "golden-password"

pytestmark = pytest.mark.timeout(60)


# -- normalising --------------------------------------------------------------------------------
_HEX_RUN = re.compile(r"(?<![0-9a-f])[0-9a-f]{16,}(?![0-9a-f])")
_CLOCK = re.compile(r"\d{13,17}")
_HOLDER_FIELD = re.compile(r'"(host|pid|since|proc)":("(?:[^"\\]|\\.)*"|[-+0-9.eE]+)')
_BARE = re.compile(r"[\x21-\x7e]+")
_HEX_LABELS = {40: "token", 24: "member"}


def parse_commands(data: bytes) -> list[list[bytes]]:
    """The commands in ``data``, each a RESP array of bulk strings as redis clients send them.

    Strict: anything else (an inline command, a length with a sign or a leading zero, a
    truncated command) is a :class:`ValueError`, so a change in framing cannot pass unseen.
    """
    commands: list[list[bytes]] = []
    position = 0

    def header(kind: bytes) -> int:
        nonlocal position
        end = data.find(b"\r\n", position)
        field = data[position + 1 : end]
        if end < 0 or data[position : position + 1] != kind or not field.isdigit():
            raise ValueError(f"not a RESP {kind!r} header at byte {position}: {data[position:][:40]!r}")
        if field != b"%d" % int(field):
            raise ValueError(f"a non-canonical length at byte {position}: {field!r}")
        position = end + 2
        return int(field)

    while position < len(data):
        command = []
        for _ in range(header(b"*")):
            size = header(b"$")
            if data[position + size : position + size + 2] != b"\r\n":
                raise ValueError(f"a bulk string of {size} bytes not ended by CRLF at byte {position}")
            command.append(data[position : position + size])
            position += size + 2
        commands.append(command)
    return commands


class _Normaliser:
    """Replaces what is random or read from a clock; one per record, so numbering starts at 1."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}
        self._counts: dict[str, int] = {}

    def _placeholder(self, value: str, label: str) -> str:
        if value not in self._seen:
            self._counts[label] = self._counts.get(label, 0) + 1
            self._seen[value] = f"<{label}#{self._counts[label]}>"
        return self._seen[value]

    def _random(self, match: re.Match[str]) -> str:
        return self._placeholder(match.group(0), _HEX_LABELS.get(len(match.group(0)), "hex"))

    def argument(self, raw: bytes) -> str:
        text = raw.decode("utf-8", "backslashreplace")
        if _CLOCK.fullmatch(text):
            return self._placeholder(text, "clock")
        text = _HOLDER_FIELD.sub(lambda m: f'"{m.group(1)}":<{m.group(1)}>', text)
        text = _HEX_RUN.sub(self._random, text)
        return text if _BARE.fullmatch(text) else repr(text)

    def command(self, args: list[bytes]) -> str:
        words = []
        loads = [word.upper() for word in args[:2]] == [b"SCRIPT", b"LOAD"]
        for i, arg in enumerate(args):
            if (i == 1 and args[0].upper() == b"EVAL") or (i == 2 and loads):
                source = arg.decode("utf-8", "backslashreplace")
                first = next((line.strip() for line in source.splitlines() if line.strip()), "")
                words.append(f"<script {hashlib.sha1(arg).hexdigest()}: {first}>")
            elif i == 1 and args[0].upper() == b"EVALSHA":
                words.append(
                    arg.decode("ascii", "backslashreplace")
                )  # derived from the source: frozen as it is
            else:
                words.append(self.argument(arg))
        return " ".join(words)


def render(kind: str, operation: str, recorded: list[list[tuple[int, bytes]]]) -> str:
    """The golden text of one operation: each master's commands, one a line, with their link."""
    normaliser = _Normaliser()
    lines = [
        f"# {kind} {operation}: the commands each master received (tests/golden/test_golden_wire.py).",
        "# Rewrite on purpose with CELERY_REDLOCK_GOLDEN_UPDATE=1; review the diff as a protocol change.",
    ]
    for index, links in enumerate(recorded):
        lines.append(f"master {index}")
        if not links:
            lines.append("  (nothing)")
        for number, data in links:
            lines += [f"  link {number}: {normaliser.command(c)}" for c in parse_commands(data)]
    return "\n".join(lines) + "\n"


def check(kind: str, operation: str, recorded: list[list[tuple[int, bytes]]]) -> None:
    text = render(kind, operation, recorded)
    path = DATA / f"{kind}-{operation}.txt"
    if UPDATE:
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            pytest.skip(f"rewrote {path}")
        return
    if not path.exists():
        pytest.fail(f"no golden file {path}: record it with CELERY_REDLOCK_GOLDEN_UPDATE=1", pytrace=False)
    expected = path.read_text()
    if text != expected:
        diff = difflib.unified_diff(
            expected.splitlines(keepends=True), text.splitlines(keepends=True), str(path), "recorded now"
        )
        pytest.fail(
            f"{kind} {operation} sends other commands than {path.name} records "
            "(if that is intended, rewrite it with CELERY_REDLOCK_GOLDEN_UPDATE=1):\n" + "".join(diff),
            pytrace=False,
        )


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers() -> Iterator[ServerSet]:
    with ServerSet(3) as started:
        for server in started:
            with direct(server) as client:
                client.acl_setuser(
                    USER,
                    enabled=True,
                    passwords=[f"+{PASSWORD}"],
                    keys=["*"],
                    channels=["*"],
                    categories=["+@all"],
                )
        yield started


@pytest.fixture
def recorder(servers: ServerSet) -> Iterator[Recorder]:
    servers.ensure_running()  # empties them: no test sees another's keys
    with Recorder([(server.host, server.port) for server in servers]) as started:
        yield started


@dataclass
class Wire:
    recorder: Recorder
    redlock: Redlock
    servers: ServerSet

    @contextmanager
    def record(self, kind: str, operation: str) -> Iterator[None]:
        """Check what the masters receive inside the block against the golden file."""
        self.recorder.mark()
        yield
        check(kind, operation, self.recorder.recorded())

    def on_every_master(self) -> Iterator[redis.Redis]:
        """A client of each master itself, around the recorder: for setup that is not recorded."""
        for server in self.servers:
            with direct(server) as client:
                yield client


@contextmanager
def direct(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def wire(servers: ServerSet, recorder: Recorder) -> Iterator[Wire]:
    """A Redlock on the recorder with one warm link per master: whether an operation's link is
    new must not depend on which tests ran before it (the handshake has tests of its own)."""
    with Redlock(recorder.urls, **SETTINGS) as redlock:
        redlock.read_everywhere("warm")
        yield Wire(recorder, redlock, servers)


@pytest.fixture
def other(servers: ServerSet) -> Iterator[Redlock]:
    """Another client, straight to the masters (not recorded): the contender's opponent."""
    with Redlock(servers.urls, **SETTINGS) as redlock:
        yield redlock


# -- a new link ---------------------------------------------------------------------------------
def test_handshake_new_link(recorder: Recorder) -> None:
    with Redlock(recorder.urls, **SETTINGS) as redlock:
        recorder.mark()
        redlock.read_everywhere("first")
        check("handshake", "new_link", recorder.recorded())


def test_handshake_new_link_with_user_database_and_name(recorder: Recorder) -> None:
    urls = [
        f"redis://{USER}:{PASSWORD}@{host}:{port}/2?client_name=golden-client"
        for host, port in recorder.addresses
    ]
    with Redlock(urls, **SETTINGS) as redlock:
        recorder.mark()
        redlock.read_everywhere("first")
        check("handshake", "new_link_user_db_name", recorder.recorded())


# -- plain locks --------------------------------------------------------------------------------
def test_plain_acquire(wire: Wire) -> None:
    lock = wire.redlock.lock("plain")
    with wire.record("plain", "acquire"):
        assert lock.acquire(blocking=False)


def test_plain_acquire_with_holder_text(wire: Wire) -> None:
    lock = wire.redlock.lock("plain", holder="report job 42")
    with wire.record("plain", "acquire_holder_text"):
        assert lock.acquire(blocking=False)


def test_plain_acquire_with_holder_record(wire: Wire) -> None:
    # As the Celery layer writes it: who and since when, which differ per run and are normalised.
    record = HolderRecord(
        task="task-id-1",
        name="golden.task",
        host=socket.gethostname(),
        pid=os.getpid(),
        ttl=10.0,
        proc=process_identity(),
    )
    lock = wire.redlock.lock("plain", holder=record.to_text(since=time.time()))
    with wire.record("plain", "acquire_holder_record"):
        assert lock.acquire(blocking=False)


def test_plain_acquire_refused(wire: Wire, other: Redlock) -> None:
    assert other.lock("plain").acquire(blocking=False)
    lock = wire.redlock.lock("plain")
    with wire.record("plain", "acquire_refused"):
        assert not lock.acquire(blocking=False)


def test_plain_acquire_refused_split_vote(wire: Wire) -> None:
    # Held on masters 0 and 1 only: master 2 grants, and gets the retraction on the same link.
    for index in (0, 1):
        with direct(wire.servers[index]) as client:
            client.set("golden:plain", "someone-else", px=10000)
    lock = wire.redlock.lock("plain")
    with wire.record("plain", "acquire_refused_split_vote"):
        assert not lock.acquire(blocking=False)


def test_plain_acquire_retries(wire: Wire, other: Redlock) -> None:
    assert other.lock("plain").acquire(blocking=False)
    lock = wire.redlock.lock("plain")
    with wire.record("plain", "acquire_retries"):
        assert not lock.acquire()  # retry_count=2: three attempts, each with a token of its own


def test_plain_acquire_waiting(recorder: Recorder, other: Redlock) -> None:
    # wait="release": after the first refusal a listening link per master (link 2) subscribes to
    # the key, and the later attempts ask for the holder's PTTL. Nobody releases, and a wait_poll
    # longer than the timeout leaves exactly three attempts: the first, the one right after
    # joining, and the one at the deadline.
    settings = {**SETTINGS, "wait": "release", "wait_poll": 5.0}
    with Redlock(recorder.urls, **settings) as redlock:
        redlock.read_everywhere("warm")
        assert other.lock("plain").acquire(blocking=False)
        lock = redlock.lock("plain")
        recorder.mark()
        assert not lock.acquire(timeout=1.0)
        # Closed before the record is taken: the subscriber thread's later traffic (a ping every
        # 5 s, an UNSUBSCRIBE after its linger) is timing, not this operation.
        redlock.close()
        check("plain", "acquire_waiting", recorder.recorded())


def test_plain_release(wire: Wire) -> None:
    lock = wire.redlock.lock("plain")
    assert lock.acquire(blocking=False)
    with wire.record("plain", "release"):
        assert lock.release()


def test_plain_release_without_waiting(wire: Wire) -> None:
    lock = wire.redlock.lock("plain")
    assert lock.acquire(blocking=False)
    with wire.record("plain", "release_without_waiting"):
        lock.release_without_waiting()


def test_plain_extend(wire: Wire) -> None:
    lock = wire.redlock.lock("plain")
    assert lock.acquire(blocking=False)
    with wire.record("plain", "extend"):
        assert lock.extend()


def test_plain_extend_to_another_ttl(wire: Wire) -> None:
    lock = wire.redlock.lock("plain")
    assert lock.acquire(blocking=False)
    with wire.record("plain", "extend_ttl"):
        assert lock.extend(25.5)


def test_plain_extend_many(wire: Wire) -> None:
    # extend_many takes its locks in id() order, and so writes them: the names are given in that
    # order, so that where two objects happen to lie in memory cannot change the record.
    first, second = sorted((Lock.__new__(Lock) for _ in range(2)), key=id)
    Lock.__init__(first, wire.redlock, "plain-a")
    Lock.__init__(second, wire.redlock, "plain-b", ttl=20.0)
    assert first.acquire(blocking=False) and second.acquire(blocking=False)
    with wire.record("plain", "extend_many"):
        assert wire.redlock.extend_many([second, first]) == [True, True]


def test_plain_locked(wire: Wire) -> None:
    lock = wire.redlock.lock("plain")
    with wire.record("plain", "locked"):
        assert not lock.locked()


def test_plain_holder(wire: Wire, other: Redlock) -> None:
    assert other.lock("plain", holder="report job 42").acquire(blocking=False)
    with wire.record("plain", "holder"):
        assert wire.redlock.holder("plain") == "report job 42"


def test_redlock_write_everywhere(wire: Wire) -> None:
    with wire.record("redlock", "write_everywhere"):
        assert wire.redlock.write_everywhere("golden:leader", "node-1", 5.0) == 3


def test_redlock_read_everywhere(wire: Wire) -> None:
    assert wire.redlock.write_everywhere("golden:leader", "node-1", 5.0) == 3
    with wire.record("redlock", "read_everywhere"):
        assert wire.redlock.read_everywhere("golden:leader") == [b"node-1"] * 3


# -- fenced locks -------------------------------------------------------------------------------
def test_fenced_acquire(wire: Wire) -> None:
    lock = wire.redlock.lock("fenced", fenced=True)
    with wire.record("fenced", "acquire"):
        assert lock.acquire(blocking=False)


def test_fenced_acquire_after_script_flush(wire: Wire) -> None:
    # Masters that lost the scripts under a live link (a new link loads them all) answer
    # NOSCRIPT to both rounds, and the transport sends each the EVAL form on the same link.
    for client in wire.on_every_master():
        client.script_flush()
    lock = wire.redlock.lock("fenced", fenced=True)
    with wire.record("fenced", "acquire_noscript"):
        assert lock.acquire(blocking=False)


def test_fenced_acquire_refused(wire: Wire, other: Redlock) -> None:
    assert other.lock("fenced").acquire(blocking=False)
    lock = wire.redlock.lock("fenced", fenced=True)
    with wire.record("fenced", "acquire_refused"):
        assert not lock.acquire(blocking=False)


def test_fenced_release(wire: Wire) -> None:
    lock = wire.redlock.lock("fenced", fenced=True)
    assert lock.acquire(blocking=False)
    with wire.record("fenced", "release"):
        assert lock.release()


def test_fenced_extend(wire: Wire) -> None:
    lock = wire.redlock.lock("fenced", fenced=True)
    assert lock.acquire(blocking=False)
    with wire.record("fenced", "extend"):
        assert lock.extend()


# -- reentrant locks ----------------------------------------------------------------------------
def test_reentrant_enter(wire: Wire) -> None:
    lock = wire.redlock.lock("reentrant", reentrant=True)
    with wire.record("reentrant", "enter"):
        assert lock.acquire(blocking=False)
    lock.release()


def test_reentrant_reenter(wire: Wire) -> None:
    lock = wire.redlock.lock("reentrant", reentrant=True)
    assert lock.acquire(blocking=False)
    with wire.record("reentrant", "reenter"):
        assert lock.acquire(blocking=False)
    assert lock.depth == 2
    lock.release()
    lock.release()


def test_reentrant_exit(wire: Wire) -> None:
    lock = wire.redlock.lock("reentrant", reentrant=True)
    assert lock.acquire(blocking=False) and lock.acquire(blocking=False)
    with wire.record("reentrant", "exit"):
        assert lock.release()
    assert lock.depth == 1
    lock.release()


def test_reentrant_final_exit(wire: Wire) -> None:
    lock = wire.redlock.lock("reentrant", reentrant=True)
    assert lock.acquire(blocking=False)
    with wire.record("reentrant", "final_exit"):
        assert lock.release()
    assert lock.depth == 0


def test_reentrant_extend(wire: Wire) -> None:
    lock = wire.redlock.lock("reentrant", reentrant=True)
    assert lock.acquire(blocking=False)
    with wire.record("reentrant", "extend"):
        assert lock.extend()
    lock.release()


def test_reentrant_acquire_refused(wire: Wire, other: Redlock) -> None:
    # The other client's masters have other names: it is another owner, whatever the thread.
    holding = other.lock("reentrant", reentrant=True)
    assert holding.acquire(blocking=False)
    lock = wire.redlock.lock("reentrant", reentrant=True)
    with wire.record("reentrant", "acquire_refused"):
        assert not lock.acquire(blocking=False)
    holding.release()


def test_reentrant_acquire_on_a_plain_lock(wire: Wire, other: Redlock) -> None:
    # Every master answers an error, and so may hold our token: each gets the retraction.
    assert other.lock("reentrant").acquire(blocking=False)
    lock = wire.redlock.lock("reentrant", reentrant=True)
    with wire.record("reentrant", "acquire_kind_mismatch"), pytest.raises(LockKindMismatch):
        lock.acquire(blocking=False)


# -- fair locks ---------------------------------------------------------------------------------
def test_fair_acquire(wire: Wire) -> None:
    lock = wire.redlock.lock("fair", fair=True)
    with wire.record("fair", "acquire"):
        assert lock.acquire(blocking=False)


def test_fair_acquire_refused(wire: Wire, other: Redlock) -> None:
    # The probe learns a ticket, so the call leaves the queue it may have joined, unwaited.
    assert other.lock("fair", fair=True).acquire(blocking=False)
    lock = wire.redlock.lock("fair", fair=True)
    with wire.record("fair", "acquire_refused"):
        assert not lock.acquire(blocking=False)


def test_fair_release(wire: Wire) -> None:
    lock = wire.redlock.lock("fair", fair=True)
    assert lock.acquire(blocking=False)
    with wire.record("fair", "release"):
        assert lock.release()


def test_fair_extend(wire: Wire) -> None:
    lock = wire.redlock.lock("fair", fair=True)
    assert lock.acquire(blocking=False)
    with wire.record("fair", "extend"):
        assert lock.extend()


# -- markers and handover -----------------------------------------------------------------------
SIDE = markers.side_key("golden:", "marked", "owner-1")


def test_marker_place(wire: Wire) -> None:
    value = markers.new_value("queued by golden")
    with wire.record("marker", "place"):
        assert markers.place(wire.redlock, "marked", SIDE, value, 10.0).value == value


def test_marker_place_refused(wire: Wire, other: Redlock) -> None:
    assert other.lock("marked", holder="running").acquire(blocking=False)
    with wire.record("marker", "place_refused"):
        placed = markers.place(wire.redlock, "marked", SIDE, markers.new_value("queued by golden"), 10.0)
    assert placed.value is None and placed.holder is not None


def test_marker_place_beside(wire: Wire, other: Redlock) -> None:
    assert other.lock("marked", holder="running").acquire(blocking=False)
    value = markers.new_value("queued by golden")
    holder = markers.place(wire.redlock, "marked", SIDE, value, 10.0).holder
    assert holder is not None
    with wire.record("marker", "place_beside"):
        assert markers.place_beside(wire.redlock, "marked", SIDE, value, 10.0, holder).key == SIDE


def test_marker_keep(wire: Wire) -> None:
    placed = markers.place(wire.redlock, "marked", SIDE, markers.new_value("q"), 2.0)
    assert placed.key is not None and placed.value is not None
    with wire.record("marker", "keep"):
        assert markers.keep(wire.redlock, placed.key, placed.value, 10.0)[0]


def test_marker_drop(wire: Wire) -> None:
    value = markers.new_value("q")
    assert markers.place(wire.redlock, "marked", SIDE, value, 10.0).value == value
    with wire.record("marker", "drop"):
        markers.drop(wire.redlock, "marked", value)


def test_marker_drop_with_side(wire: Wire) -> None:
    value = markers.new_value("q")
    assert markers.place(wire.redlock, "marked", SIDE, value, 10.0).value == value
    with wire.record("marker", "drop_with_side"):
        markers.drop(wire.redlock, "marked", value, SIDE)


def test_marker_hand_back(wire: Wire) -> None:
    lock = wire.redlock.lock("marked")
    assert lock.acquire(blocking=False) and lock.token is not None
    with wire.record("marker", "hand_back"):
        assert markers.hand_back(wire.redlock, lock.key, lock.token, markers.new_value("retry"), 10.0)


def test_handover_acquire(wire: Wire) -> None:
    value = markers.new_value("queued by golden")
    assert markers.place(wire.redlock, "marked", SIDE, value, 10.0).value == value
    lock = markers.HandoverLock(wire.redlock, "marked", marker=value, side=SIDE)
    with wire.record("handover", "acquire"):
        assert lock.acquire(blocking=False)


def test_handover_refused_gives_the_marker_back(wire: Wire, other: Redlock) -> None:
    """An attempt only master 0 granted: its retraction there puts the marker back beside the key."""
    holder = other.lock("marked", holder="running")
    assert holder.acquire(blocking=False) and holder.token is not None
    value = markers.new_value("queued by golden")
    assert markers.place_beside(wire.redlock, "marked", SIDE, value, 10.0, holder.token).key == SIDE
    first = next(iter(wire.on_every_master()))
    first.delete("golden:marked")  # the holder's key gone on master 0 only
    lock = markers.HandoverLock(wire.redlock, "marked", marker=value, side=SIDE)
    with wire.record("handover", "refused"):
        assert not lock.acquire(blocking=False)
    assert wire.redlock.read_everywhere(SIDE) == [value.encode()] * 3


def test_handover_release(wire: Wire) -> None:
    value = markers.new_value("queued by golden")
    assert markers.place(wire.redlock, "marked", SIDE, value, 10.0).value == value
    lock = markers.HandoverLock(wire.redlock, "marked", marker=value, side=SIDE)
    assert lock.acquire(blocking=False)
    with wire.record("handover", "release"):
        assert lock.release()


# -- operators' reads ---------------------------------------------------------------------------
def test_admin_show(wire: Wire, other: Redlock) -> None:
    assert other.lock("plain", holder="report job 42").acquire(blocking=False)
    with wire.record("admin", "show"):
        assert admin.show(wire.redlock, "plain").held


def test_admin_list_locks(wire: Wire, other: Redlock) -> None:
    assert other.lock("plain").acquire(blocking=False)
    with wire.record("admin", "list_locks"):
        assert [view.name for view in admin.list_locks(wire.redlock).locks] == ["plain"]


def test_admin_force_release(wire: Wire, other: Redlock) -> None:
    assert other.lock("plain").acquire(blocking=False)
    view = admin.show(wire.redlock, "plain")
    with wire.record("admin", "force_release"):
        assert admin.force_release(wire.redlock, view, by="golden test").deleted == 3


def test_admin_health(wire: Wire) -> None:
    with wire.record("admin", "health"):
        assert len(admin.health(wire.redlock).masters) == 3
