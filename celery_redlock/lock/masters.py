"""The fast transport's names where they were before it was split into
:mod:`celery_redlock.lock.transport` (one module per idea); kept so that imports of this path
go on working."""

from .transport.commands import (
    GRANTED,
    HELD,
    NOSCRIPT,
    Command,
    Outcome,
    common_outcome,
    script_template,
)
from .transport.identity import refuse_shared_servers
from .transport.link import Link
from .transport.linkset import LinkSet
from .transport.master import BACKOFF_CAP, BACKOFF_FLOOR, MAX_CONNECTS, Master
from .transport.round import Round

__all__ = [
    "BACKOFF_CAP",
    "BACKOFF_FLOOR",
    "GRANTED",
    "HELD",
    "MAX_CONNECTS",
    "NOSCRIPT",
    "Command",
    "Link",
    "LinkSet",
    "Master",
    "Outcome",
    "Round",
    "common_outcome",
    "refuse_shared_servers",
    "script_template",
]
