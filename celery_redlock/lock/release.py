"""An operator's release of a stuck lock: ``celery redlock release`` (re-exported by
:mod:`.admin`, the operators' API). Not the holder's own release (:meth:`.resource.Lock.release`):
this one frees a lock whose holder cannot. Knows nothing of Celery.

- :func:`release`: without ``force``, only when :func:`.liveness.liveness` shows the holder
  dead (see :mod:`.liveness` for the rule), then :func:`force_release` of the token shown;
- :func:`force_release`: the compare-and-delete of exactly the token that was shown, so a lock
  taken since by someone else is left alone.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
from dataclasses import dataclass

from ..errors import RedlockError
from .commands import PLAIN, REENTRANT
from .liveness import DEFAULT_WATCH, Liveness, liveness
from .lockview import DEFAULT_TIMEOUT, LockView, show
from .redlock import Redlock

# The operators' API's logger, not this module's: operators route a force-release's WARNING by
# that name, and it stays the same wherever the code lives.
logger = logging.getLogger("celery_redlock.admin")


class ReleaseRefused(RedlockError):
    """A release that was not done: its holder is not shown dead (see :mod:`.liveness`), or the
    lock is no longer held by the token that was shown. The message says which, and what to do."""


@dataclass(frozen=True)
class Released:
    """A force-release: how many masters deleted the token (``deleted``), of ``masters``."""

    name: str
    token: str
    deleted: int
    masters: int
    by: str


def operator_identity() -> str:
    """``user@host pid N``: who ran a force-release, for the log line it leaves."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without passwd entry)
        user = f"uid {os.getuid()}"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def force_release(
    redlock: Redlock,
    view: LockView,
    *,
    token: str | None = None,
    by: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Released:
    """Delete ``view``'s lock on every master that still holds exactly its token (or ``token``),
    compare-and-delete, so a lock taken since by someone else is left alone. Waiters are woken
    as by a release. Logged at WARNING with ``by`` (default :func:`operator_identity`).

    Does not check liveness: :func:`release` does, or call :func:`.liveness.liveness` first.
    """
    token = token if token is not None else view.token
    if token is None:
        raise ReleaseRefused(f"lock {view.name!r} has no token to release: no master holds it")
    commands = REENTRANT if view.kind == "reentrant" else PLAIN
    command = commands.release.pack(view.key, token)
    with redlock._round() as rnd:
        outcomes = rnd.call([command] * len(redlock.masters), timeout)
    deleted = sum(1 for o in outcomes if o.kind == "ok" and o.value == 1)
    by = by or operator_identity()
    holder = view.describe_holder() or "?"  # a label of one's own is named too, not only a record
    logger.warning(
        "force-released %s (token %s..., held by %s) on %d of %d masters, by %s",
        view.key,
        token[:12],
        holder,
        deleted,
        len(outcomes),
        by,
    )
    return Released(view.name, token, deleted, len(outcomes), by)


def release(
    redlock: Redlock,
    name: str,
    *,
    token: str | None = None,
    force: bool = False,
    watch: float = DEFAULT_WATCH,
    by: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[Released, Liveness | None]:
    """Release the lock on resource ``name``: :func:`.lockview.show`, then unless ``force``
    :func:`.liveness.liveness` (refused with :class:`ReleaseRefused` unless its holder is shown
    dead or its validity has run out; see :mod:`.liveness`), then at once :func:`force_release`
    of the token shown. ``watch`` bounds the watch (seconds); the watch ends as soon as the rule
    has its answer. ``token``, if given, must be the one most masters hold (what an operator was
    shown earlier), else the release is refused. ``force`` releases whatever holds it, alive
    or not, even on fewer masters than a quorum."""
    view = show(redlock, name, timeout=timeout)
    if token is not None and view.token != token:
        raise ReleaseRefused(
            f"lock {name!r} is no longer held by the token shown ({token[:12]}...): "
            f"now {'free' if view.token is None else view.token[:12] + '...'}; show it again"
        )
    if view.token is None:
        raise ReleaseRefused(f"lock {name!r} is not held: no master holds a lock on it")
    alive = None
    if not force:
        alive = liveness(redlock, view, watch=watch, timeout=timeout)
        if not alive.releasable:
            raise ReleaseRefused(f"lock {name!r} not released: its holder is {alive.state}: {alive.reason}")
    return force_release(redlock, view, by=by, timeout=timeout), alive
