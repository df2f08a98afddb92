"""The ``redlock_*`` settings of a Celery app: read, validated, and turned into one Redlock per process.

Settings are read from ``app.conf`` the first time a locked task runs in a process (or at worker
start, for the start-up checks), and every bad value raises :class:`ConfigError` naming the
setting. The :class:`Redlock` built from them is cached per app and per process id: a prefork
child builds its own after the fork, so no two processes ever share a socket to a master.

See ``docs/settings.md`` for the table of settings and task options.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .redlock import MAX_RELEASE_LINGER, Redlock

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


def positive(name: str, value: object, *, allow_none: bool = False,
             allow_zero: bool = False) -> float | None:
    """``value`` as a float > 0 (or >= 0), else a ConfigError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def count_or_none(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0 or None, got {value!r}")
    return value


def choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return str(value)


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
    drift = positive("redlock_drift_factor", get("redlock_drift_factor"), allow_zero=True)
    assert drift is not None
    if drift >= 0.5:
        raise ConfigError(f"redlock_drift_factor must be < 0.5, got {drift!r}")
    settings = RedlockSettings(
        masters=_masters(conf.get("redlock_masters")),
        ttl=positive("redlock_ttl", get("redlock_ttl")) or 0.0,
        request_timeout=positive("redlock_request_timeout", get("redlock_request_timeout")) or 0.0,
        drift_factor=drift,
        key_prefix=prefix,
        heartbeat_interval=positive("redlock_heartbeat_interval", get("redlock_heartbeat_interval"),
                                    allow_none=True),
        contended=choice("redlock_contended", get("redlock_contended"), CONTENDED_POLICIES),
        retry_backoff=positive("redlock_retry_backoff", get("redlock_retry_backoff"),
                               allow_zero=True) or 0.0,
        retry_backoff_max=positive("redlock_retry_backoff_max", get("redlock_retry_backoff_max"),
                                   allow_zero=True) or 0.0,
        max_retries=count_or_none("redlock_max_retries", get("redlock_max_retries")),
        release_linger=_release_linger(get("redlock_release_linger")),
    )
    return settings


def _release_linger(value: object) -> float:
    linger = positive("redlock_release_linger", value, allow_zero=True) or 0.0
    if linger > MAX_RELEASE_LINGER:
        raise ConfigError(
            f"redlock_release_linger must be at most {MAX_RELEASE_LINGER} s: it delays a finished "
            f"task's release by up to that much; got {value!r}"
        )
    return linger


_cache: dict[int, tuple[int, RedlockSettings, Redlock]] = {}
_cache_lock = threading.Lock()
# Read once and again in each forked child: os.getpid() is a system call, and this runs per task.
_pid = os.getpid()


def app_redlock(app: Any) -> tuple[RedlockSettings, Redlock]:
    """The settings and this process's :class:`Redlock` for ``app``, built on first use.

    Rebuilt when the process id changed (a prefork child), so connections are never inherited.
    """
    pid = _pid
    with _cache_lock:
        cached = _cache.get(id(app))
        if cached is not None and cached[0] == pid:
            return cached[1], cached[2]
        settings = read_settings(app.conf)
        redlock = Redlock(
            list(settings.masters), ttl=settings.ttl, retry_count=0,
            drift_factor=settings.drift_factor, request_timeout=settings.request_timeout,
            key_prefix=settings.key_prefix, release_linger=settings.release_linger,
        )
        _cache[id(app)] = (pid, settings, redlock)
        logger.debug("process %d: %r for app %s", pid, redlock, getattr(app, "main", app))
        return settings, redlock


def close_app_redlock(app: Any | None = None) -> None:
    """Close and forget this process's Redlock (for ``app``, or every app)."""
    with _cache_lock:
        keys = list(_cache) if app is None else [id(app)]
        entries = [_cache.pop(k) for k in keys if k in _cache]
    for pid, _, redlock in entries:
        if pid == os.getpid():
            redlock.close()


def _forget_after_fork() -> None:
    global _cache_lock, _pid
    _pid = os.getpid()
    # The parent's connections belong to the parent: drop them without closing.
    _cache.clear()
    _cache_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
