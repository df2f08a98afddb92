"""The ``redlock_*`` settings of a Celery app: read, validated, and turned into one Redlock per process.

Settings are read from ``app.conf`` the first time a locked task runs in a process (or at worker
start, for the start-up checks), and every bad value raises :class:`ConfigError` naming the
setting. The :class:`Redlock` built from them is cached per app and per process: a prefork
child forgets its parent's and builds its own, so no two processes ever share a socket to a master.

See ``docs/settings.md`` for the table of settings and task options.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._fork import on_fork_in_child, pid
from .._validate import choice, count, number
from ..errors import ConfigError
from ..lock.redlock import MAX_RELEASE_LINGER, Redlock

logger = logging.getLogger("celery_redlock.settings")

CONTENDED_POLICIES = ("retry", "skip", "fail")
RELEASE_POLICIES = ("on_return", "on_expiry")

# name -> default; the one place defaults live (docs/settings.md describes each).
DEFAULTS: dict[str, Any] = {
    "redlock_masters": None,
    "redlock_ttl": 30.0,
    "redlock_request_timeout": 0.1,
    "redlock_drift_factor": 0.01,
    "redlock_key_prefix": "redlock:",
    "redlock_heartbeat_interval": None,
    "redlock_contended": "retry",
    "redlock_retry_backoff": 1.0,
    "redlock_retry_backoff_max": 60.0,
    "redlock_max_retries": None,
    "redlock_release_linger": 0.02,
}


@dataclass(frozen=True)
class RedlockSettings:
    """The validated ``redlock_*`` settings of one app."""

    masters: tuple[str, ...]
    ttl: float
    request_timeout: float
    drift_factor: float
    key_prefix: str
    heartbeat_interval: float | None
    contended: str
    retry_backoff: float
    retry_backoff_max: float
    max_retries: int | None
    release_linger: float

    def redlock(self, *, linger: bool = True) -> Redlock:
        """A new Redlock over these settings; ``linger=False`` sends every release at once
        (the beat's leader lock: its release must not wait for company that never comes)."""
        return Redlock(
            list(self.masters),
            ttl=self.ttl,
            retry_count=0,
            drift_factor=self.drift_factor,
            request_timeout=self.request_timeout,
            key_prefix=self.key_prefix,
            release_linger=self.release_linger if linger else 0.0,
        )


def _masters(value: object) -> tuple[str, ...]:
    if value is None:
        raise ConfigError(
            "redlock_masters is not set: configure app.conf.redlock_masters with the URLs of the "
            "independent Redis masters, e.g. ['redis://10.0.0.1:6379/0', ...] (an odd number, "
            "5 is usual)"
        )
    if isinstance(value, str):
        # A comma-separated string, so the setting can come straight from an environment variable.
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(f"redlock_masters must be a non-empty list of redis URLs, got {value!r}")
    for url in value:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"redlock_masters: {url!r} is not a redis URL (redis://host:port/db)")
    return tuple(value)


def read_settings(conf: Mapping[str, Any]) -> RedlockSettings:
    """Validate the ``redlock_*`` settings of ``conf`` (an ``app.conf``)."""

    def get(name: str) -> Any:
        value = conf.get(name, None)
        return DEFAULTS[name] if value is None else value

    prefix = get("redlock_key_prefix")
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(f"redlock_key_prefix must be a non-empty str, got {prefix!r}")
    # None (the default) means: every ttl / 3, and no limit.
    interval, max_retries = get("redlock_heartbeat_interval"), get("redlock_max_retries")
    return RedlockSettings(
        masters=_masters(conf.get("redlock_masters")),
        ttl=number("redlock_ttl", get("redlock_ttl"), above=0, unit="seconds"),
        request_timeout=number(
            "redlock_request_timeout", get("redlock_request_timeout"), above=0, unit="seconds"
        ),
        drift_factor=number("redlock_drift_factor", get("redlock_drift_factor"), at_least=0, below=0.5),
        key_prefix=prefix,
        heartbeat_interval=None
        if interval is None
        else number("redlock_heartbeat_interval", interval, above=0, unit="seconds"),
        contended=choice("redlock_contended", get("redlock_contended"), CONTENDED_POLICIES),
        retry_backoff=number(
            "redlock_retry_backoff", get("redlock_retry_backoff"), at_least=0, unit="seconds"
        ),
        retry_backoff_max=number(
            "redlock_retry_backoff_max", get("redlock_retry_backoff_max"), at_least=0, unit="seconds"
        ),
        max_retries=None if max_retries is None else count("redlock_max_retries", max_retries),
        release_linger=number(
            "redlock_release_linger",
            get("redlock_release_linger"),
            at_least=0,
            at_most=MAX_RELEASE_LINGER,
            unit="seconds",
            why="it delays a finished task's release by up to that much",
        ),
    )


_cache: dict[int, tuple[RedlockSettings, Redlock]] = {}
_cache_lock = threading.Lock()


def app_redlock(app: Any) -> tuple[RedlockSettings, Redlock]:
    """The settings and this process's :class:`Redlock` for ``app``, built on first use.

    A forked child (a prefork pool's process) starts with an empty cache and builds its own, so
    connections are never inherited.
    """
    with _cache_lock:
        cached = _cache.get(id(app))
        if cached is not None:
            return cached
        settings = read_settings(app.conf)
        redlock = settings.redlock()
        _cache[id(app)] = (settings, redlock)
        logger.debug("process %d: %r for app %s", pid(), redlock, getattr(app, "main", app))
        return settings, redlock


def close_app_redlock(app: Any | None = None) -> None:
    """Close and forget this process's Redlock (for ``app``, or every app)."""
    with _cache_lock:
        keys = list(_cache) if app is None else [id(app)]
        entries = [_cache.pop(k) for k in keys if k in _cache]
    for _, redlock in entries:
        redlock.close()


def _after_fork_in_child() -> None:
    global _cache_lock
    # The parent's Redlocks are the parent's: dropped, not closed (each Master forgets its
    # parent's connections on its own), so the child builds its own on first use.
    _cache.clear()
    _cache_lock = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_after_fork_in_child)
