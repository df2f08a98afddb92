"""The type of a Lua script (:mod:`.scripts` holds every one), and the registry by digest
through which a transport turns an ``EVALSHA`` answered NOSCRIPT into the ``EVAL`` of the same
script, and a new link loads every script a master runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

# Every script by its digest (hex), as Script registers itself: how a transport turns an
# EVALSHA a master answered NOSCRIPT into the EVAL of the same script (see the module docstring).
_BY_DIGEST: dict[str, Script] = {}


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    # False for a script sent to a data server (the fenced resources), never to a lock master:
    # a new link to a master loads only the others.
    on_masters: bool = True
    sha1: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha1", hashlib.sha1(self.source.encode()).hexdigest())
        _BY_DIGEST.setdefault(self.sha1, self)


def by_digest(sha1: str) -> Script | None:
    """The registered script whose digest is ``sha1`` (hex), or None."""
    return _BY_DIGEST.get(sha1)


def for_masters() -> list[Script]:
    """Every registered script a lock master runs, in the order they were defined."""
    return [script for script in _BY_DIGEST.values() if script.on_masters]
