"""What the algorithm asks of a transport: send these commands to these masters within a
deadline, and return one outcome each.

The algorithm (votes, validity, retries, waiting) lives in :mod:`..redlock` and the lock kinds;
it reaches the masters only through an :class:`Exchange`, one per lock operation, taken from a
:class:`Transport`. Two transports keep this contract:

- ``"fast"`` (:mod:`.fast`, the default): non-blocking links driven by one poll per round, links
  parked whole between rounds, connects on threads of their own;
- ``"redis-py"`` (:mod:`.reference`): redis-py connection pools and one thread per master, plain
  enough to be read as obviously correct; the core contract tests run over both.

The contract every exchange keeps, whatever carries it:

- ``outcomes[i]`` is master i's, in the masters' order; a ``None`` command skips master i and its
  outcome is an error saying it was not sent.
- **Bounded:** a call returns by ``timeout`` (connects included); a master that has not answered
  by then gets a ``timeout`` outcome, and never slows the others.
- **Ordered per master within an exchange:** a command sent to master i after another one in the
  same exchange is executed by that master after it, even when the first one's reply was late.
  This is what keeps a release from overtaking the late acquire it undoes.
- **Not lost:** a ``send`` (nobody waits) and a ``call(keep=True)`` (a release) reach every master
  in the end, even when no connection could be made in time: what could not be written is kept
  and written on that master's next connection.
- ``enough=k``: return as soon as ``k`` masters answered ``ok``; the other replies are still read
  (and skipped) before that connection carries anything else.
- **Scripts by digest** (see :mod:`..scripts`): a script command (``EVALSHA``, built by
  :func:`.commands.script_template`) that a master answers NOSCRIPT (it ran nothing) is sent to
  it again as ``EVAL`` on the same connection, by the same deadline; the outcome is the script's
  reply, never the NOSCRIPT. A reply nobody waits for may be read too late for that (the fast
  transport): it is then logged at WARNING, naming the master. Every new connection loads every
  script first, so that takes a ``SCRIPT FLUSH`` under a live connection.
- Common replies (``b"OK"``, ``1``, ``0``, ``None``) come back as the shared outcomes of
  :func:`.commands.common_outcome`, so callers may count them by identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .commands import Command, Outcome


class Exchange(Protocol):
    """One lock operation's access to the masters (a context manager: ``close`` ends it)."""

    def call(
        self, commands: Sequence[Command | None], timeout: float, *, keep: bool = False, enough: int = 0
    ) -> list[Outcome]:
        """Send ``commands[i]`` to master i and wait for the replies by one deadline."""
        ...

    def call_many(self, batches: Sequence[Sequence[Command]], timeout: float) -> list[list[Outcome]]:
        """Send every command of ``batches[i]`` to master i (pipelined) and read them all."""
        ...

    def send(self, commands: Sequence[Command | None], timeout: float) -> None:
        """Send ``commands[i]`` to master i without waiting for the replies."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Exchange: ...

    def __exit__(self, *exc: object) -> None: ...


class Transport(Protocol):
    """The masters, as the algorithm sees them: exchanges over them, and a close."""

    def round(self) -> Exchange:
        """A new exchange for one lock operation."""
        ...

    def close(self) -> None:
        """Close every idle connection; the transport stays usable (it reconnects)."""
        ...

    def after_fork_in_child(self) -> None:
        """Forget the parent's connections without touching them (they are the parent's)."""
        ...
