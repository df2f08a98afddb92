"""The operators' commands as click commands, built over a :class:`Frontend`: where the masters
come from is the front end's (a Celery app's settings, or ``--masters``); the options, help,
confirmation, output and exit statuses are these, the same for both.

``celery redlock`` (:mod:`celery_redlock.celery.command`) and ``celery-redlock``
(:mod:`.standalone`) each call :func:`build_commands` with their own front end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import click

from ..lock import admin
from . import commands, exits
from .commands import Session
from .output import Output


class Frontend(Protocol):
    """Where the commands' masters come from."""

    def params(self) -> list[click.Parameter]:
        """Options of the front end's own, added to every command (``--masters``...)."""

    def session(self, ctx: click.Context, given: dict[str, Any]) -> Session:
        """The masters for this command, from ``given`` (the values of :meth:`params`) and
        the context; a bad value raises a click usage error naming it (exit status 2)."""


def _timeout() -> click.Option:
    return click.Option(
        ["--timeout"],
        type=click.FloatRange(min=0, min_open=True),
        default=admin.DEFAULT_TIMEOUT,
        show_default=True,
        help="Seconds each round may wait for the masters' replies (connects are bounded by "
        "the masters' request_timeout).",
    )


def _json() -> click.Option:
    return click.Option(
        ["--json", "as_json"],
        is_flag=True,
        help="Print one JSON document on stdout (its fields: the page named below); everything "
        "else goes to stderr.",
    )


def _ls_params() -> list[click.Parameter]:
    return [
        click.Argument(["pattern"], default="*", required=False),
        click.Option(
            ["--limit"],
            type=click.IntRange(min=1),
            default=1000,
            show_default=True,
            help="Most keys looked at; the listing says when it stopped there.",
        ),
        click.Option(
            ["--all", "partial"], is_flag=True, help="Also locks held on fewer masters than a quorum."
        ),
    ]


def _release_params() -> list[click.Parameter]:
    return [
        click.Argument(["resource"]),
        click.Option(["--yes"], is_flag=True, help="Do not ask for confirmation."),
        click.Option(
            ["--force"],
            is_flag=True,
            help="Release whatever holds it: a holder not shown dead, a queued message's marker, "
            "a token on fewer masters than a quorum, or with fewer than a quorum answering.",
        ),
        click.Option(
            ["--watch"],
            type=click.FloatRange(min=0),
            default=admin.DEFAULT_WATCH,
            show_default=True,
            help="Seconds to watch at most for the holder to be shown dead; the watch ends at "
            "the first answer.",
        ),
    ]


def _leader_params() -> list[click.Parameter]:
    return [
        click.Option(
            ["--lock-name"],
            help="The beat's leader lock. A beat's is its redlock_beat_lock_name, else "
            'beat:<app name>, the name given to Celery(...) (beat:proj for Celery("proj"); '
            "beat:celery for an unnamed app). Default: the app's under `celery redlock`, "
            "beat:celery under `celery-redlock`.",
        )
    ]


@dataclass(frozen=True)
class _Spec:
    name: str
    body: Callable[..., int]
    params: Callable[[], list[click.Parameter]]
    help: str
    short: str


_SPECS = (
    _Spec(
        "ls",
        commands.ls,
        _ls_params,
        """List the locks held on a quorum whose resource matches PATTERN (a glob; default all).

        Found with SCAN (never KEYS), at most --limit keys. One line each: resource, holder,
        age, TTL left on a quorum, how many masters hold its token. A queued message's marker
        reads "queued: task <name> <id>" (a marker waiting beside another holder is listed
        under <resource>~enqueued:<task>).

        Exit status 0 when the listing is complete, 1 when it is not (stopped at --limit, or a
        master did not answer), 3 when fewer than a quorum answered.
        """,
        "List the locks held on a quorum.",
    ),
    _Spec(
        "show",
        commands.show,
        lambda: [click.Argument(["resource"])],
        """Show the lock on RESOURCE on every master: token, holder, PTTL; and whether a quorum
        holds it.

        Exit status 0 when a quorum holds it, 1 when not, 3 when fewer than a quorum answered.
        """,
        "Show one lock on every master.",
    ),
    _Spec(
        "release",
        commands.release,
        _release_params,
        """Release the lock on RESOURCE: delete on every master exactly the token shown
        (compare-and-delete), and log who did it (WARNING on celery_redlock.admin).

        Without --force, only a holder shown dead is released: its process gone (its record
        names this host and a pid that no longer runs), or no extension seen on a quorum for
        longer than its recorded heartbeat interval plus a margin while watched; or a lock whose
        validity has run out anyway. Everything else is refused: a holder seen extending it, a
        queued message's marker, a holder with no heartbeat interval recorded and validity
        left, or one that cannot be shown dead within --watch. A release without --force never
        breaks a live holder.

        Exit status 0 released (or nothing held), 1 refused or not confirmed, 3 fewer than a
        quorum answered (nothing released).
        """,
        "Release a stuck lock whose holder is shown dead.",
    ),
    _Spec(
        "health",
        commands.health,
        lambda: [],
        """Check every master: reachable, round-trip time, version, role, persistence, eviction
        policy, clock offset, and whether the lock's commands and scripts run.

        Exit status 0 every master sound; 1 degraded (a master failing or warned of, a quorum
        sound); 3 unsafe (fewer than a quorum sound: no lock can be taken).
        """,
        "Check the masters' fitness to hold locks.",
    ),
    _Spec(
        "leader",
        commands.leader,
        _leader_params,
        """Show the beat process that holds the leader lock (RedlockScheduler).

        Exit status 0 when a quorum of masters names a leader, 1 when none does, 3 when fewer
        than a quorum answered.
        """,
        "Show which beat leads.",
    ),
)


def _callback(frontend: Frontend, body: Callable[..., int], own: list[str]) -> Callable[..., None]:
    @click.pass_context
    def run(ctx: click.Context, /, **options: Any) -> None:
        given = {name: options.pop(name) for name in own}
        out = Output(options.pop("as_json"))
        session = frontend.session(ctx, given)
        ctx.exit(body(session, out, **options))

    return run


def build_commands(frontend: Frontend) -> list[click.Command]:
    """``ls``, ``show``, ``release``, ``health``, ``leader`` over ``frontend``'s masters."""
    built = []
    for spec in _SPECS:
        own = frontend.params()
        built.append(
            click.Command(
                spec.name,
                callback=_callback(frontend, spec.body, [str(p.name) for p in own]),
                params=[*spec.params(), _json(), _timeout(), *own],
                help=spec.help,
                short_help=spec.short,
                epilog=exits.EPILOG,
            )
        )
    return built
