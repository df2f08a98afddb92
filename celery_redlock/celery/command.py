"""``celery -A proj redlock ...``: the operators' commands, run with the app's own settings.

- ``leader``: which beat process holds the leader lock, read from the leader record every
  master keeps (see :mod:`celery_redlock.beat`). Exit status 0 when a quorum of masters names a
  leader, 1 when none does.
- ``ls``, ``show``, ``release``, ``health``: who holds what, one lock per master, a stuck lock
  freed by hand, the masters' fitness. They print what :mod:`celery_redlock.lock.admin` returns
  (the same functions are its Python API); see docs/operations.md.

Registered through the ``celery.commands`` entry point.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from ..errors import ConfigError
from ..lock import admin
from ..lock.redlock import Redlock
from ..lock.resource import lock_key
from .beatconf import BeatSettings
from .leader import leader_redlock, read_leader
from .settings import read_settings


@click.group(name="redlock")
def redlock() -> None:
    """celery-redlock: who holds the locks, and the masters' health."""


@redlock.command()
@click.option("--json", "as_json", is_flag=True, help="Print the leader record as JSON.")
@click.pass_context
def leader(ctx: click.Context, as_json: bool) -> None:
    """Show the beat process that holds the leader lock (RedlockScheduler)."""
    app: Any = ctx.obj.app
    try:
        settings = BeatSettings.from_conf(app.conf, app.main)
        locks = leader_redlock(app.conf)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        record = read_leader(locks, settings.lock_name)
        key = lock_key(locks.key_prefix, settings.lock_name)
    finally:
        locks.close()
    if as_json:
        click.echo(json.dumps(record))
    elif record is None:
        click.echo(f"no beat leader: no quorum of masters names one for {key}")
    else:
        since = dt.datetime.fromtimestamp(float(record["since"]), tz=dt.timezone.utc)
        click.echo(
            f"beat leader for {key}: {record['hostname']} pid {record['pid']}, "
            f"since {since.isoformat(timespec='seconds')} (lock ttl {record['ttl']:g}s)"
        )
    ctx.exit(0 if record is not None else 1)


_TIMEOUT = click.option(
    "--timeout",
    type=click.FloatRange(min=0.001),
    default=admin.DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds each round may wait for the masters.",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@contextmanager
def _app_redlock(ctx: click.Context) -> Iterator[Redlock]:
    """A Redlock over the app's masters for this command, closed after it."""
    app: Any = ctx.obj.app
    try:
        locks = read_settings(app.conf).redlock()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        yield locks
    finally:
        locks.close()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _holder(view: admin.LockView) -> str:
    """Who holds it; a queued message's marker says ``queued:`` and names its task id."""
    return "-" if view.token is None else view.describe_holder()


@redlock.command(name="ls")
@click.argument("pattern", default="*")
@click.option(
    "--limit", type=click.IntRange(min=1), default=1000, show_default=True, help="Most keys looked at."
)
@click.option("--all", "partial", is_flag=True, help="Also locks held on fewer masters than a quorum.")
@_JSON
@_TIMEOUT
@click.pass_context
def ls(ctx: click.Context, pattern: str, limit: int, partial: bool, as_json: bool, timeout: float) -> None:
    """List the locks held on a quorum whose resource matches PATTERN (a glob; default all).

    Found with SCAN (never KEYS), at most --limit keys. One line each: resource, holder, age,
    TTL left on a quorum, how many masters hold its token. A queued message's marker reads
    "queued: task <name> <id>" (a marker waiting beside another holder is listed under
    <resource>~enqueued:<task>).
    """
    with _app_redlock(ctx) as locks:
        listing = admin.list_locks(locks, pattern, limit=limit, partial=partial, timeout=timeout)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "locks": [view.as_dict() for view in listing.locks],
                    "complete": listing.complete,
                    "errors": listing.errors,
                }
            )
        )
        return
    rows = [
        (
            view.name,
            _holder(view),
            _seconds(view.age),
            _seconds(view.ttl_left),
            f"{view.agree}/{len(view.masters)}" + (f" +{view.queued} queued" if view.queued else ""),
        )
        for view in listing.locks
    ]
    _table(("RESOURCE", "HOLDER", "AGE", "TTL LEFT", "MASTERS"), rows)
    for master, why in listing.errors.items():
        click.echo(f"warning: {master} did not answer the scan: {why}", err=True)
    if not listing.complete:
        click.echo(f"warning: incomplete listing (stopped at --limit {limit} keys, or a master)", err=True)


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        click.echo("  ".join(cells).rstrip())


def _heartbeat(view: admin.LockView) -> str:
    """How often its record says its holder extends it (what ``release`` watches for)."""
    holder = view.holder
    if view.marker:
        return ""
    if holder is None or holder.heartbeat is None:
        return "; no heartbeat interval recorded"
    return f"; extended every {holder.heartbeat:g} s (recorded)"


def _print_view(view: admin.LockView) -> None:
    rows = []
    for m in view.masters:
        if m.tokens:
            for token, count in m.tokens:
                mark = "*" if token == view.token else " "
                extra = f" x{count}" if m.kind == "reentrant" else ""
                rows.append((m.master, m.kind, f"{mark}{token[: admin.TOKEN_HEX]}{extra}", _seconds(m.pttl)))
        else:
            rows.append((m.master, m.kind, m.error or "-", _seconds(m.pttl)))
    _table(("MASTER", "KIND", "TOKEN", "PTTL"), rows)
    if view.held:
        click.echo(
            f"{view.key}: held on a quorum ({view.agree} of {len(view.masters)} masters, quorum "
            f"{view.quorum}) by {_holder(view)}; {_seconds(view.ttl_left)} left{_heartbeat(view)}"
        )
    else:
        click.echo(
            f"{view.key}: not held on a quorum ({view.agree} of {len(view.masters)} masters hold "
            f"one token, quorum {view.quorum})"
        )
    if view.queued:
        click.echo(f"{view.queued} waiting in its fair queue")


@redlock.command()
@click.argument("resource")
@_JSON
@_TIMEOUT
@click.pass_context
def show(ctx: click.Context, resource: str, as_json: bool, timeout: float) -> None:
    """Show the lock on RESOURCE on every master: token, holder, PTTL; and whether a quorum
    holds it. Exit status 0 when a quorum holds it, 1 when not."""
    with _app_redlock(ctx) as locks:
        view = admin.show(locks, resource, timeout=timeout)
    if as_json:
        click.echo(json.dumps(view.as_dict()))
    else:
        _print_view(view)
    ctx.exit(0 if view.held else 1)


@redlock.command()
@click.argument("resource")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--force",
    is_flag=True,
    help="Release whatever holds it: a holder not shown dead, or a token on fewer masters than a quorum.",
)
@click.option(
    "--watch",
    type=click.FloatRange(min=0),
    default=admin.DEFAULT_WATCH,
    show_default=True,
    help="Seconds to watch at most for the holder to be shown dead; the watch ends at the first answer.",
)
@_TIMEOUT
@click.pass_context
def release(ctx: click.Context, resource: str, yes: bool, force: bool, watch: float, timeout: float) -> None:
    """Release the lock on RESOURCE: delete on every master exactly the token shown
    (compare-and-delete), and log who did it.

    Without --force, only a holder shown dead is released: its process gone (its record names
    this host and a pid that no longer runs), or no extension seen on a quorum for longer than
    its recorded heartbeat interval plus a margin while watched; or a lock whose validity has
    run out anyway. Everything else is refused: a holder seen extending it, a queued message's
    marker, a holder with no heartbeat interval recorded and validity left, or one that cannot
    be shown dead within --watch. See docs/operations.md.
    """
    with _app_redlock(ctx) as locks:
        view = admin.show(locks, resource, timeout=timeout)
        _print_view(view)
        if view.token is None:
            click.echo(f"nothing to release: no master holds a lock on {resource!r}")
            ctx.exit(0)
        if not yes:
            # Asked before the watch, so that the release follows the answer at once.
            when = "" if force else " if its holder is shown dead"
            click.confirm(f"release {view.key} (token {view.token[:12]}...){when}?", abort=True)
        if not force:
            if not view.marker:
                click.echo(f"watching whether its holder is shown dead (at most {watch:g} s)...")
            alive = admin.liveness(locks, view, watch=watch, timeout=timeout)
            click.echo(f"holder is {alive.state}: {alive.reason}")
            if not alive.releasable:
                raise click.ClickException(
                    f"refused: its holder is {alive.state}; use --force to release anyway"
                )
        done = admin.force_release(locks, view, by=f"{admin.operator_identity()} (celery redlock release)")
    click.echo(
        f"released {view.key} (token {done.token[:12]}...) on {done.deleted} of {done.masters} "
        f"masters, by {done.by}"
    )


def _health_row(m: admin.MasterHealth) -> tuple[str, ...]:
    """One master's line of the ``health`` table; "-" where the check could not tell."""
    persistence = "-"
    if m.appendonly is not None:
        persistence = f"aof {m.appendfsync or '?'}" if m.appendonly else "none"
    return (
        m.master,
        "up" if m.reachable else "DOWN",
        "-" if m.rtt is None else f"{m.rtt * 1000:.2f} ms",
        "-" if m.version is None else f"{m.server} {m.version}",
        m.role or "-",
        persistence,
        m.maxmemory_policy or "-",
        "-" if m.clock_offset is None else f"{m.clock_offset * 1000:+.1f} ms",
        "-" if m.commands_run is None else ("yes" if m.commands_run else "NO"),
    )


@redlock.command()
@_JSON
@_TIMEOUT
@click.pass_context
def health(ctx: click.Context, as_json: bool, timeout: float) -> None:
    """Check every master: reachable, round-trip time, version, role, persistence, eviction
    policy, clock offset, and whether the lock's commands and scripts run.

    Exit status 0: every master sound; 1: degraded (a master failing or warned of, a quorum
    sound); 2: unsafe (fewer than a quorum sound: no lock can be taken).
    """
    with _app_redlock(ctx) as locks:
        report = admin.health(locks, timeout=timeout)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        ctx.exit(report.exit_code)
    rows = [_health_row(m) for m in report.masters]
    _table(("MASTER", "STATE", "RTT", "VERSION", "ROLE", "PERSIST", "EVICTION", "CLOCK", "SCRIPTS"), rows)
    for m in report.masters:
        for finding in m.findings:
            click.echo(f"{m.master}: {finding}")
    sound = f"{report.sound} of {len(report.masters)} sound, quorum {report.quorum}"
    click.echo(f"fleet: {report.status} ({sound})")
    ctx.exit(report.exit_code)
