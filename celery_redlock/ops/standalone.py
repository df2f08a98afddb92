"""``celery-redlock ls|show|release|health|leader``: the operators' commands without a Celery
app, over the masters named by ``--masters`` or the environment (a cron job, a service that uses
``Redlock`` directly). The commands are :mod:`.cli`'s, the same as ``celery redlock``'s.

Each setting comes from its option, else its environment variable, else its default: the
command line wins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ..errors import ConfigError
from ..lock.redlock import Redlock
from . import exits
from .cli import build_commands

MASTERS_ENV = "CELERY_REDLOCK_MASTERS"
KEY_PREFIX_ENV = "CELERY_REDLOCK_KEY_PREFIX"
REQUEST_TIMEOUT_ENV = "CELERY_REDLOCK_REQUEST_TIMEOUT"
# RedlockScheduler's default lock name for an app named "celery" (beat:<app.main>).
DEFAULT_LEADER_LOCK = "beat:celery"
PROGRAM = "celery-redlock"


def split_masters(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    """``--masters``: comma-separated redis URLs (``redis://``, ``rediss://``, ``unix://``); each
    is checked when the masters are built (:class:`Redlock` names what is wrong with it)."""
    if value is None:
        return None
    urls = [url.strip() for url in value.split(",") if url.strip()]
    if not urls:
        # click records where a value came from only after this callback: a value equal to the
        # environment variable's is taken to be from there (if the option said the same, the
        # variable is as wrong).
        envvar = param.envvar if isinstance(param.envvar, str) else None
        from_env = envvar is not None and os.environ.get(envvar) == value
        raise click.BadParameter(
            f"no master URL in {value!r}: expected redis://host:port[,redis://...]",
            ctx,
            param_hint=f"${envvar}" if from_env else "'--masters'",
        )
    return urls


def _masters_hint(ctx: click.Context) -> str:
    """Where the masters' bad value came from: the option, or the environment variable."""
    source = ctx.get_parameter_source("masters")
    return f"${MASTERS_ENV}" if source == click.core.ParameterSource.ENVIRONMENT else "'--masters'"


class Standalone:
    """The front end whose masters are given on the command line or in the environment."""

    def params(self) -> list[click.Parameter]:
        return [
            click.Option(
                ["--masters"],
                callback=split_masters,
                metavar="URL,URL,...",
                envvar=MASTERS_ENV,
                show_envvar=True,
                help=f"The lock masters, comma-separated redis URLs (the option wins over ${MASTERS_ENV}).",
            ),
            click.Option(
                ["--key-prefix"],
                envvar=KEY_PREFIX_ENV,
                show_envvar=True,
                default="redlock:",
                show_default=True,
                help="The prefix of the lock keys (the app's redlock_key_prefix).",
            ),
            click.Option(
                ["--request-timeout"],
                type=click.FloatRange(min=0, min_open=True),
                envvar=REQUEST_TIMEOUT_ENV,
                show_envvar=True,
                default=0.1,
                show_default=True,
                help="The request_timeout the locks' users run with (redlock_request_timeout): "
                "release's liveness margin and health's round-trip warning are reckoned from it, "
                "and it bounds each connect.",
            ),
        ]

    def session(self, ctx: click.Context, given: dict[str, Any]) -> _Session:
        masters = given["masters"]
        if masters is None:
            raise click.UsageError(f"no masters: give --masters URL,URL,... or set ${MASTERS_ENV}", ctx)
        try:
            redlock = Redlock(
                masters, request_timeout=given["request_timeout"], key_prefix=given["key_prefix"]
            )
        except ConfigError as exc:
            # The other options' values are checked by their click types: what Redlock
            # refuses here is a master URL.
            raise click.BadParameter(str(exc), ctx, param_hint=_masters_hint(ctx)) from None
        return _Session(redlock)


class _Session:
    program = PROGRAM

    def __init__(self, redlock: Redlock) -> None:
        self._redlock = redlock

    @contextmanager
    def redlock(self) -> Iterator[Redlock]:
        try:
            yield self._redlock
        finally:
            self._redlock.close()

    @contextmanager
    def leader(self, lock_name: str | None) -> Iterator[tuple[Redlock, str]]:
        with self.redlock() as locks:
            yield locks, lock_name or DEFAULT_LEADER_LOCK


def group() -> click.Group:
    """The ``celery-redlock`` command group with the operators' commands (``__main__`` adds
    ``demo``)."""
    commands = click.Group(
        PROGRAM,
        help="celery-redlock: who holds the locks, the masters' health, a stuck lock freed by "
        f"hand; with no Celery app: the masters come from --masters or ${MASTERS_ENV} (the option "
        "wins). Under Celery, `celery -A proj redlock ...` runs the same commands with the app's "
        "settings.",
        epilog=exits.EPILOG,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for command in build_commands(Standalone()):
        commands.add_command(command)
    return commands
