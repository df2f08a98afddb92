"""``celery -A proj redlock leader``: which beat process holds the leader lock, read from the
leader record every master keeps (see :mod:`celery_redlock.beat`).

Registered through the ``celery.commands`` entry point, so it runs with the app's own settings.
Exit status 0 when a quorum of masters names a leader, 1 when none does.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import click

from ..errors import ConfigError
from ..lock.resource import lock_key
from .beat import BeatSettings, leader_redlock, read_leader


@click.group(name="redlock")
def redlock() -> None:
    """celery-redlock: who holds the locks."""


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
