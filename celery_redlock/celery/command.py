"""``celery -A proj redlock ...``: the operators' commands, run with the app's own settings.

``ls``, ``show``, ``release``, ``health``, ``leader``: who holds what, one lock per master, a
stuck lock freed by hand, the masters' fitness, which beat leads. The commands themselves are
:mod:`celery_redlock.ops` (also the standalone ``celery-redlock``, which takes ``--masters``
instead of an app): this module only says where the masters come from, the app's ``redlock_*``
settings (and ``redlock_beat_*`` for ``leader``). See docs/cli.md and docs/operations.md.

Registered through the ``celery.commands`` entry point.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ..errors import ConfigError
from ..lock.redlock import Redlock
from ..ops import exits
from ..ops.cli import build_commands
from .beatconf import BeatSettings
from .leader import leader_redlock
from .settings import read_settings, refuse_unknown_settings

PROGRAM = "celery redlock"


class AppFrontend:
    """The masters of the Celery app the ``celery`` command was given (``-A proj``)."""

    def params(self) -> list[click.Parameter]:
        return []

    def session(self, ctx: click.Context, given: dict[str, Any]) -> _AppSession:
        return _AppSession(ctx.obj.app)


class _AppSession:
    program = PROGRAM

    def __init__(self, app: Any) -> None:
        self._app = app

    @contextmanager
    def redlock(self) -> Iterator[Redlock]:
        try:
            # A misspelt setting is refused as the worker and the beat refuse it (``leader``'s
            # leader_redlock checks it too): its default would be in force unnoticed.
            refuse_unknown_settings(self._app.conf)
            locks = read_settings(self._app.conf).redlock()
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        try:
            yield locks
        finally:
            locks.close()

    @contextmanager
    def leader(self, lock_name: str | None) -> Iterator[tuple[Redlock, str]]:
        app = self._app
        try:
            settings = BeatSettings.from_conf(app.conf, app.main)
            locks = leader_redlock(app.conf)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        try:
            yield locks, lock_name or settings.lock_name
        finally:
            locks.close()


@click.group(name="redlock", epilog=exits.EPILOG)
def redlock() -> None:
    """celery-redlock: who holds the locks, and the masters' health."""


for _command in build_commands(AppFrontend()):
    redlock.add_command(_command)
