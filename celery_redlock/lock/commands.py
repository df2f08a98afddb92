"""What each kind of lock sends: its acquire, release and extend commands, packed from
templates (only key, token and TTL are encoded per call). The Lua behind them is in
:mod:`.scripts`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import scripts, wire
from .transport.commands import script_template

ACQUIRE = wire.Template(("SET", wire.SLOT, wire.SLOT, "NX", "PX", wire.SLOT))  # key token <ms>
RELEASE = script_template(scripts.RELEASE, 1, 1)  # key token
EXTEND = script_template(scripts.EXTEND, 1, 2)  # key token <ms>


@dataclass(frozen=True)
class Commands:
    """The three commands one kind of lock is taken, released and extended with, packed from
    (key, token[, ttl ms]). A grant answers ``+OK``; a release or extension answers 1 if the
    token held the key."""

    acquire: wire.Template
    release: wire.Template
    extend: wire.Template


PLAIN = Commands(ACQUIRE, RELEASE, EXTEND)
# A waiting plain lock's later attempts: refusals carry the holder's remaining TTL.
PLAIN_WAITING = Commands(script_template(scripts.ACQUIRE_WAIT, 1, 2), RELEASE, EXTEND)
# A reentrant lock's key is a hash {token: count} (see scripts.py and reentrant.py).
REENTRANT = Commands(
    script_template(scripts.R_ACQUIRE, 1, 2),
    script_template(scripts.R_RELEASE, 1, 1),
    script_template(scripts.R_EXTEND, 1, 2),
)
# The reentrant lock's re-entry and inner exit (see reentrant.py).
ENTER = script_template(scripts.R_ENTER, 1, 2)  # key token <ms>
EXIT = script_template(scripts.R_EXIT, 1, 1)  # key token


def milliseconds(ttl: float) -> int:
    """The TTL a master is sent: rounded up, never down, so no master drops a key sooner than
    the validity counted from ``ttl`` assumes."""
    return math.ceil(ttl * 1000)
