"""What travels to the masters and back: a command (arguments, or bytes packed once by a
:class:`~..wire.Template`), and one :class:`Outcome` per master.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .. import scripts, wire

# A command as its arguments, or already packed (bytes) by a wire.Template.
Command = tuple[Any, ...] | bytes


@dataclass(frozen=True, eq=False)
class Outcome:
    """One master's answer to one command: a reply, an error, or no answer in time.

    Compared by identity (``eq=False``): the usual outcomes are shared objects (see
    ``COMMON_OK``), so a round counts its grants with ``list.count`` at C speed.
    """

    kind: Literal["ok", "error", "timeout"]
    value: Any = None
    detail: str = ""


NOT_SENT = Outcome("error", detail="not sent")
# A master's answer to EVALSHA of a script it does not have (restarted, SCRIPT FLUSH): nothing ran.
NOSCRIPT = "NOSCRIPT"
# How an error reply reads in an outcome's detail, over either transport.
REPLY_ERROR = "ResponseError: "
LATE = Outcome("timeout", detail="no reply within request_timeout")
QUEUED_BEHIND_LATE = Outcome("timeout", detail="queued behind a reply that is late")
NOT_AWAITED = Outcome("timeout", detail="not waited for once a quorum had answered")
# Lock commands answer with one of a handful of values; their outcomes are shared, not rebuilt
# once per master per round (Outcome is immutable).
COMMON_OK = {value: Outcome("ok", value) for value in (b"OK", 1, 0, None)}


# What one recv usually holds (see wire.SHORT_RUNS), as (how many replies, the last one's outcome).
SHORT_OUTCOMES = {data: (count, COMMON_OK[reply]) for data, (count, reply) in wire.SHORT_RUNS.items()}


def common_outcome(value: Any) -> Outcome:
    """The shared outcome of a reply ``value`` (b"OK", 1, 0 or None): compare by identity."""
    return COMMON_OK[value]


# The outcome of a granted SET, shared by every master that granted one, and of a SET NX
# refused because the key is there.
GRANTED = COMMON_OK[b"OK"]
HELD = COMMON_OK[None]
# The outcome of a release that deleted its key (the scripts' DEL: 1), shared likewise.
DELETED = COMMON_OK[1]


def pack_command(command: Command) -> bytes:
    return command if type(command) is bytes else wire.pack(command)


def is_noscript(outcome: Outcome) -> bool:
    """Whether ``outcome`` is a master's NOSCRIPT: it did not have the script, and ran nothing."""
    return outcome.kind == "error" and outcome.detail.startswith(REPLY_ERROR + NOSCRIPT)


def script_template(
    script: scripts.Script, keys: int | Sequence[Any], args: int | Sequence[Any]
) -> wire.Template:
    """The one way a script command is built: ``EVALSHA`` of ``script``'s digest, then its keys
    and its arguments. ``keys`` and ``args`` are how many of each a call gives
    (``.pack(*keys, *args)``), or the values themselves with :data:`~..wire.SLOT` where a call
    gives one (the others are packed once, as a HandoverLock's marker).

    A master without the script answers NOSCRIPT and runs nothing; the transport then sends it
    the command's :func:`eval_form` (see scripts.py for the policy).
    """
    key_values = [wire.SLOT] * keys if isinstance(keys, int) else list(keys)
    arg_values = [wire.SLOT] * args if isinstance(args, int) else list(args)
    return wire.Template(("EVALSHA", script.sha1, len(key_values), *key_values, *arg_values))


# What every command script_template packs starts with, right after its array header
# (``*<n>\r\n``): the name, then the digest's bulk header and its 40 hex digits.
_EVALSHA = b"$7\r\nEVALSHA\r\n$40\r\n"
_EVAL = b"$4\r\nEVAL\r\n"


def eval_form(command: Command | None) -> bytes | None:
    """The ``EVAL`` form of ``command``, packed, if it is an ``EVALSHA`` of a registered script
    (else None): the same array, with the script's source where its digest was. What a master
    that answered NOSCRIPT is sent instead; off the usual path (a flushed script cache)."""
    if command is None:
        return None
    packed = pack_command(command)
    start = packed.find(b"\r\n") + 2
    digest_at = start + len(_EVALSHA)
    if packed[start:digest_at] != _EVALSHA:
        return None
    script = scripts.by_digest(packed[digest_at : digest_at + 40].decode("ascii", "replace"))
    if script is None:
        return None
    source = script.source.encode("utf-8", "surrogatepass")
    return b"%b%b$%d\r\n%b%b" % (packed[:start], _EVAL, len(source), source, packed[digest_at + 40 :])


def script_loads() -> list[tuple[str, str, str]]:
    """``SCRIPT LOAD`` of every script a lock master runs: what each new link sends with its
    handshake (no round trip of its own), so a master has them all before any is sent by digest,
    a restarted one included."""
    return [("SCRIPT", "LOAD", script.source) for script in scripts.for_masters()]
