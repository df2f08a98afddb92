"""Who holds a lock: the holder record stored beside its token, and how it reads in a message.

The Celery layer writes a :class:`HolderRecord` as the holder text of each run's lock (in the
acquire's own SET) and of each queued message's marker; ``Redlock.lock(..., holder=...)`` users
may write any text. The record is JSON, with one writer (:meth:`HolderRecord.to_text`) and one
parser (:func:`parse`): text that is not a record parses to None, a field of the wrong type reads
as absent, and a record written before a field existed parses without it. Whether a record is a
queued marker is its ``queued`` field, never a word found in the text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import Any

from . import scripts
from .transport.commands import Command, Outcome, script_template

# Between a token's random part and the holder text stored with it (see Redlock.lock).
HOLDER_SEPARATOR = "|"

# The fields a run's record shares with every other run of its task in this process, in the
# order they are written after the per-run ones (task, since), before the last (publish).
_SHARED = ("name", "host", "pid", "proc", "ttl", "heartbeat", "queued", "published")

# INSPECT's one template (keys: the lock key, its queue's key): this module's holder read and
# the operators' view (lockview.py) both send it.
INSPECT = script_template(scripts.INSPECT, 2, 0)


@dataclass(frozen=True)
class HolderRecord:
    """Who took a lock, as recorded beside its token.

    ``task`` is the task id, ``name`` the task's name, ``host`` and ``pid`` the process that
    took it, ``since`` when (epoch seconds, that host's clock), ``ttl`` the lock's TTL and
    ``heartbeat`` how often its holder extends it (seconds; None when not known). ``publish`` is
    the id of the publish whose message the run (or marker) belongs to (Celery's
    ``redlock_publish`` header): new for each publish, kept by the message's broker redeliveries
    and retries, so a contender can tell an earlier attempt of its own message from another
    publish that reused its task id. A *marker* (``queued``: the lock taken at publish, for a
    message still waiting in the broker) names the queued task and its publisher's host and pid;
    ``published`` says the broker has accepted its message (written once the publish returned,
    see ``markers.keep``): until then (False), nothing is known to carry the task id it names.
    A marker's record always says which (None: a record that does not, written by a version
    without the flag, whose marker is taken as published).
    """

    task: str | None = None
    name: str | None = None
    host: str | None = None
    pid: int | None = None
    since: float | None = None
    ttl: float | None = None
    heartbeat: float | None = None
    queued: bool = False
    publish: str | None = None
    # Which process ``pid`` is (see process_identity): a host name and a pid alone do not tell a
    # process apart from one in another container or pid namespace that shares the host name.
    proc: str | None = None
    published: bool | None = False

    def __post_init__(self) -> None:
        if not self.queued and self.published is not False:  # a run's record: it is no marker
            object.__setattr__(self, "published", False)

    @functools.cached_property
    def _shared_text(self) -> str:
        # Written once per record: a task caches one record for its runs and fills in the rest.
        fields = {key: getattr(self, key) for key in _SHARED}
        fields["queued"] = fields["queued"] or None  # written only when true
        # A marker says whether its message is published, explicitly: false is not "unknown",
        # which a reader could only guess at by the marker's age, across hosts' clocks.
        fields["published"] = fields["published"] if self.queued else None
        kept = {key: value for key, value in fields.items() if value is not None}
        return json.dumps(kept, separators=(",", ":"))[1:-1]

    def to_text(
        self, *, task: str | None = None, since: float | None = None, publish: str | None = None
    ) -> str:
        """The record as one line of JSON; ``task``, ``since`` and ``publish``, when given, in
        place of the record's own. The per-run form: a task keeps one record for all its runs in
        a process, and each run writes its own three fields into it with one string format."""
        task = self.task if task is None else task
        since = self.since if since is None else since
        publish = self.publish if publish is None else publish
        shared = self._shared_text
        if task is not None and since is not None and shared:
            text = f'{{"task":{encode_basestring_ascii(task)},"since":{since:.3f},{shared}'
            return text + "}" if publish is None else f'{text},"publish":{encode_basestring_ascii(publish)}}}'
        parts = [] if task is None else [f'"task":{encode_basestring_ascii(task)}']
        if since is not None:
            parts.append(f'"since":{since:.3f}')
        if shared:
            parts.append(shared)
        if publish is not None:
            parts.append(f'"publish":{encode_basestring_ascii(publish)}')
        return "{" + ",".join(parts) + "}"

    def age(self, at: float | None = None) -> float | None:
        """Seconds since it was taken (by this machine's clock), when the record says when."""
        if self.since is None:
            return None
        return max(0.0, (time.time() if at is None else at) - self.since)

    def describe(self, at: float | None = None) -> str:
        """``task charge_invoice 8c1f... on worker-3 pid 4411 for 12.4 s``; a marker reads
        ``queued: task charge_invoice 8c1f..., published on worker-3 pid 4411 12.4 s ago``."""
        if self.task is None and self.name is None and self.host is None and self.pid is None:
            return "an unnamed holder"
        who = " ".join(["task", *(p for p in (self.name, self.task) if p)])
        where = [f"on {self.host}"] if self.host is not None else []
        if self.pid is not None:
            where.append(f"pid {self.pid}")
        age = self.age(at)
        if not self.queued:
            return " ".join([who, *where, *([f"for {age:.1f} s"] if age is not None else [])])
        published = [*where, *([f"{age:.1f} s ago"] if age is not None else [])]
        return f"queued: {who}" + (", published " + " ".join(published) if published else "")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse(text: str) -> HolderRecord | None:
    """The record in a holder text, or None when the text is not one (a label of one's own)."""
    if not text.startswith("{"):
        return None
    try:
        fields = json.loads(text)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    return HolderRecord(
        task=_typed(fields.get("task"), str),
        name=_typed(fields.get("name"), str),
        host=_typed(fields.get("host"), str),
        pid=_typed(fields.get("pid"), int),
        since=_seconds(fields.get("since")),
        ttl=_seconds(fields.get("ttl")),
        heartbeat=_seconds(fields.get("heartbeat")),
        queued=fields.get("queued") is True,
        publish=_typed(fields.get("publish"), str),
        proc=_typed(fields.get("proc"), str),
        published=_typed_bool(fields.get("published")) if fields.get("queued") is True else False,
    )


def _typed_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _typed(value: Any, kind: type) -> Any:
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def describe_holder(text: str | None, at: float | None = None) -> str:
    """How a holder text reads in a message: its record described, else the text itself."""
    if text is None:
        return ""
    record = parse(text)
    said = "an unnamed holder" if record is None else record.describe(at)
    if said == "an unnamed holder" and text:
        return repr(text)  # a label of one's own, or a record that names nobody: as it is
    return said


def holder_read(key: str) -> Command:
    """What reads who holds lock key ``key`` on one master: INSPECT (one atomic look), which
    answers for a plain lock's string and a reentrant lock's hash alike, where a GET of a hash
    is refused (WRONGTYPE) and a contender would learn nothing of its holder."""
    # The queue's length is not wanted here: the lock key stands in for the queue's key (a lock
    # key is never a sorted set, so INSPECT counts 0 for it).
    return INSPECT.pack(key, key)


def holder_of(outcomes: Sequence[Outcome], quorum: int) -> str | None:
    """The holder text of the token a quorum of masters hold, from each master's reply to
    :func:`holder_read` (see :func:`agreed`): a plain lock's value, or the one token of a
    reentrant lock's hash (one owner holds it at a time)."""
    values: list[bytes | None] = []
    for outcome in outcomes:
        reply = outcome.value if outcome.kind == "ok" else None
        # {type, pttl, queued, value} for a string; {type, pttl, queued, token, count} for a hash
        # that one owner holds; anything else (absent, several tokens, an error) holds none.
        if isinstance(reply, list) and len(reply) == {b"string": 4, b"hash": 5}.get(reply[0]):
            values.append(reply[3] if isinstance(reply[3], bytes) else None)
        else:
            values.append(None)
    return agreed(values, quorum)


def agreed(values: list[bytes | None], quorum: int) -> str | None:
    """The holder text of the token a quorum of masters hold (each master's value of the lock
    key, None where absent or not answered), "" if it was taken without one; None when no
    quorum holds one token. The token's random part is dropped (it names nobody)."""
    counts: dict[bytes, int] = {}
    for value in values:
        if value is not None:
            counts[value] = counts.get(value, 0) + 1
    for value, held in counts.items():
        if held >= quorum:
            return value.decode("utf-8", "replace").partition(HOLDER_SEPARATOR)[2]
    return None


def process_identity(pid: int | None = None) -> str | None:
    """``boot id:pid namespace:start time`` of process ``pid`` (this one by default), or None
    where /proc does not say (not Linux, or the process is gone).

    What makes "its pid no longer runs here" a proof of death: the same boot (not a host that
    rebooted), the same pid namespace (not a container that shares the host name), and the same
    start time (not a later process that reused the pid).
    """
    target = "self" if pid is None else str(pid)
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat(f"/proc/{target}/ns/pid").st_ino
        with open(f"/proc/{target}/stat", "rb") as stat:
            started = stat.read().rpartition(b")")[2].split()[19].decode()
    except (OSError, IndexError):
        return None
    return f"{boot_id}:{namespace}:{started}"
