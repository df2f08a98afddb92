"""The ``redlock_*`` settings of a Celery app: read, validated, and turned into one Redlock per process.

Settings are read from ``app.conf`` the first time a locked task runs in a process, and at worker
start by the start-up checks, which stop a worker whose settings would fail every locked run.
Every bad value raises :class:`ConfigError` naming the setting. The :class:`Redlock` built from
them is cached per app and per process: a prefork child forgets its parent's and builds its own,
so no two processes ever share a socket to a master.

A change to ``app.conf`` after first use is picked up by the next locked run (the README's
testing recipe sets ``app.conf.redlock_masters`` in each test). Each run compares the raw values
of the ``redlock_*`` keys in ``app.conf``'s own dict (where every write through ``app.conf``
lands) with those it last read, plus which dicts ``app.conf`` reads from (so a later
``config_from_object`` or ``add_defaults`` counts too): a few dict look-ups, where one
``app.conf.get`` costs several microseconds. A change re-reads and re-validates everything; a
new Redlock is built only when something it is made of changed, and the old one is closed. A
lock already held stays on the Redlock that took it, whose masters it is extended and released
on. A key that looks like one of ours but is not (``redlock_tll``) is logged once per process with
the closest known name, before the settings are read, so the warning comes first when the typo
makes a required setting missing.

See ``docs/settings.md`` for the table of settings and task options.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .._fork import on_fork_in_child, pid
from .._validate import choice, count, flag, number
from ..errors import ConfigError
from ..lock.redlock import Redlock

logger = logging.getLogger("celery_redlock.settings")

CONTENDED_POLICIES = ("retry", "skip", "fail", "wait")
RELEASE_POLICIES = ("on_return", "on_expiry")
# lock_enqueue / redlock_enqueue: what a publish finds when its key is already queued or running.
ENQUEUE_MODES = ("return_existing", "raise")

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
    "redlock_wait_timeout": 10.0,
    "redlock_reentrant": False,
    "redlock_fenced": False,
    "redlock_fence_retention": 86400.0,
    # The Prometheus metrics (the `metrics` extra): off, True (collected), or where to serve them.
    "redlock_metrics": False,
    "redlock_enqueue": None,
    # As long as a Redis broker's default visibility_timeout: a message held longer than that
    # unacknowledged is delivered again anyway.
    "redlock_enqueue_ttl": 3600.0,
}
# Read by the HA beat (BeatSettings.from_conf in .beatconf), listed here so that every name the
# package reads is known in one place, for the unknown-name check.
BEAT_SETTINGS = (
    "redlock_beat_lock_name",
    "redlock_beat_lock_ttl",
    "redlock_beat_min_validity",
    "redlock_beat_standby_interval",
    "redlock_beat_scheduler",
    "redlock_beat_scheduler_state",
    "redlock_beat_align_intervals",
    "redlock_beat_align_anchor",
)
# Accepted and ignored, with a warning at worker start (see check_app): a finished run's release
# now waits for the masters' replies, so there is nothing left for it to tune.
DEPRECATED_SETTINGS = {
    "redlock_release_linger": "a finished run's release now waits for the masters' replies",
}
KNOWN_SETTINGS = frozenset(DEFAULTS).union(BEAT_SETTINGS, DEPRECATED_SETTINGS)

# Celery's own settings read with ours, so that a run finds them in its RedlockSettings: one
# ``app.conf`` look-up costs several microseconds, and a run would make it every time.
CELERY_SETTINGS_READ = ("task_time_limit",)
# Every key a change to which makes the settings be read again.
WATCHED_SETTINGS = (*DEFAULTS, *CELERY_SETTINGS_READ)

# The fields of RedlockSettings a Redlock is made of: a change in any of them needs a new one.
REDLOCK_FIELDS = ("masters", "ttl", "request_timeout", "drift_factor", "key_prefix")

_generations = itertools.count(1)


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
    wait_timeout: float = DEFAULTS["redlock_wait_timeout"]
    reentrant: bool = False
    fenced: bool = False
    fence_retention: float = DEFAULTS["redlock_fence_retention"]
    enqueue: str | None = None
    enqueue_ttl: float = DEFAULTS["redlock_enqueue_ttl"]
    # Celery's ``task_time_limit``, as the app has it (Celery checks it, not us): the hard limit
    # that caps a prefork child's heartbeat when neither the call nor the task sets one.
    task_time_limit: Any = None
    # Unique to each read in this process, and left out of ==: what a cache of values derived
    # from the settings is keyed on. An id() is not enough, as a newer settings object can be
    # given the id of an older one that was freed.
    generation: int = field(default_factory=lambda: next(_generations), compare=False, repr=False)

    def redlock(self) -> Redlock:
        """A new Redlock over these settings."""
        return Redlock(
            list(self.masters),
            ttl=self.ttl,
            retry_count=0,
            drift_factor=self.drift_factor,
            request_timeout=self.request_timeout,
            key_prefix=self.key_prefix,
            fence_retention=self.fence_retention,
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
        wait_timeout=wait_timeout_setting("redlock_wait_timeout", get("redlock_wait_timeout")),
        reentrant=flag("redlock_reentrant", get("redlock_reentrant")),
        fenced=flag("redlock_fenced", get("redlock_fenced")),
        fence_retention=number(
            "redlock_fence_retention", get("redlock_fence_retention"), above=0, unit="seconds"
        ),
        enqueue=enqueue_mode("redlock_enqueue", conf.get("redlock_enqueue", None)),
        enqueue_ttl=number("redlock_enqueue_ttl", get("redlock_enqueue_ttl"), above=0, unit="seconds"),
        task_time_limit=conf.get("task_time_limit", None),
    )


def metrics_setting(value: object) -> bool | tuple[str, int]:
    """``redlock_metrics``: False or None (off); True (collected into prometheus-client's
    registry, exposed by whatever serves it); a port (also served at ``/metrics`` on every
    interface by the worker's main process); or ``"host:port"`` (served on that address)."""
    if value is None or value is False or value is True:
        return bool(value)
    if isinstance(value, int) and not isinstance(value, bool):
        host, port = "", value
    elif isinstance(value, str) and value.rpartition(":")[2].isdigit():
        host, _, digits = value.rpartition(":")
        port = int(digits)
    else:
        raise ConfigError(f"redlock_metrics must be False, True, a port or 'host:port', got {value!r}")
    if not 0 < port < 65536:
        raise ConfigError(f"redlock_metrics: port must be 1-65535, got {port!r}")
    return host.strip("[]"), port


def wait_timeout_setting(name: str, value: object) -> float:
    """How long a contended run may wait in its worker (``lock_contended="wait"``): finite and
    above 0. No "for ever": the run keeps its worker slot while it waits."""
    return number(name, value, above=0, unit="seconds", why="a waiting run keeps its worker slot")


def enqueue_mode(name: str, value: object) -> str | None:
    """What a publish does when its key is taken (``lock_enqueue``): one of ``ENQUEUE_MODES``, or
    None for no marker at publish (``False`` says so too, where None means "the app's")."""
    if value is None or value is False:
        return None
    return choice(name, value, ENQUEUE_MODES)


def new_redlock(settings: RedlockSettings) -> Redlock:
    """``settings.redlock()``, its errors named by the setting: the Redlock constructor
    refuses what no round could use (two masters that are one server, a TTL below its
    ``min_ttl``) under its own argument names, ``masters`` or ``ttl``."""
    try:
        return settings.redlock()
    except ConfigError as exc:
        raise ConfigError(f"redlock_{exc}") from None


def unknown_settings(conf: Mapping[str, Any]) -> list[str]:
    """One message per key of ``conf`` that looks like a celery-redlock setting but is not read.

    A key is read if Celery's look-up of a known name tries it: with a ``config_from_object``
    namespace such as ``"CELERY"`` that is ``CELERY_REDLOCK_TTL`` and ``redlock_ttl``, not
    ``REDLOCK_TTL``. With a namespace, only keys in it and lower-case keys (Celery's own style)
    are looked at: the other settings of a shared settings module, such as Django's, are
    somebody else's.
    """
    keys = list(conf)  # first: listing a Celery conf still pending loads it, namespace and all
    prefix = str(getattr(conf, "prefix", None) or "")
    to_keys = getattr(conf, "_to_keys", None)  # Celery's own list of keys tried for a name

    def keys_of(name: str) -> tuple[str, ...]:
        return tuple(to_keys(name)) if to_keys is not None else (name,)

    read = {key for name in KNOWN_SETTINGS for key in keys_of(name)}
    messages = []
    for key in keys:
        if not isinstance(key, str) or key in read:
            continue
        looks_like_ours = _setting_named(key, prefix)
        if looks_like_ours is None:
            continue
        bare, namespaced = looks_like_ours
        close = _closest_setting(bare)
        if close is None:
            messages.append(f"{key!r} is not a celery-redlock setting (docs/settings.md lists them)")
        else:
            meant = keys_of(close)[0] if namespaced else close
            messages.append(f"{key!r} is not a celery-redlock setting; did you mean {meant!r}?")
    return messages


def _setting_named(key: str, prefix: str) -> tuple[str, bool] | None:
    """The setting name ``key`` spells (lower-case, outside the namespace ``prefix``) and whether
    it is in that namespace; None for a key that does not begin ``redlock_`` or is somebody else's
    (outside the namespace, and not lower-case)."""
    namespaced = bool(prefix) and key.upper().startswith(prefix.upper())
    if prefix and not (namespaced or key.islower()):
        return None
    bare = (key[len(prefix) :] if namespaced else key).lower()
    return (bare, namespaced) if bare.startswith("redlock_") else None


def _closest_setting(bare: str) -> str | None:
    """The known setting whose name is closest to ``bare``'s, if any is close."""
    # Matched on what follows "redlock_": the prefix all share would make any name look close.
    known = {name.removeprefix("redlock_"): name for name in KNOWN_SETTINGS}
    close = difflib.get_close_matches(bare.removeprefix("redlock_"), sorted(known), n=1)
    return known[close[0]] if close else None


def refuse_unknown_settings(conf: Mapping[str, Any]) -> None:
    """A :class:`ConfigError` naming every :func:`unknown_settings` key, if any: a misspelt
    setting silently ignored would leave its default in force (a TTL, the masters) unnoticed."""
    messages = unknown_settings(conf)
    if messages:
        raise ConfigError("; ".join(messages))


class _Entry:
    """One app's settings and Redlock in this process, and what of ``app.conf`` they came from."""

    __slots__ = ("absent", "changes", "conf", "depth", "pick", "raw", "redlock", "settings")
    settings: RedlockSettings
    redlock: Redlock

    def __init__(self, conf: Any) -> None:
        """A snapshot of ``conf``; ``settings`` and ``redlock`` are set once they are read."""
        self.conf = conf
        # Every write through app.conf (attribute, item, update, setdefault, pop) lands in its
        # changes dict; its other maps (a config_from_object source, Celery's defaults) change
        # only by a new conf or changes dict (config_from_object) or one more map (add_defaults).
        # A Mapping that is not Celery's is its own changes.
        self.changes: Mapping[str, Any] = getattr(conf, "changes", conf)
        self.depth = len(getattr(conf, "maps", ()))
        to_keys = getattr(conf, "_to_keys", None)  # Celery's list of the keys tried for a name
        keys = dict.fromkeys(
            WATCHED_SETTINGS if to_keys is None else (k for name in WATCHED_SETTINGS for k in to_keys(name))
        )
        # The keys set now are compared by value; those not set need only stay absent, which
        # one isdisjoint() tells for all of them (a look-up per key costs twice as much).
        present = [key for key in keys if key in self.changes]
        self.absent = frozenset(keys).difference(present)
        self.pick: Callable[[Mapping[str, Any]], Any] = operator.itemgetter(*present) if present else _nothing
        self.raw = _copied(self.pick(self.changes), len(present))

    def current(self, conf: Any) -> bool:
        """Whether ``conf`` (``app.conf`` now) still holds what the settings were read from.

        The hot path: once per locked run, about 0.3 µs. An unchanged value
        compares by identity, a copied list element by element.
        """
        changes = self.changes
        if (
            conf is not self.conf
            or getattr(conf, "changes", conf) is not changes
            or len(getattr(conf, "maps", ())) != self.depth
            or not changes.keys().isdisjoint(self.absent)
        ):
            return False
        try:
            return bool(self.pick(changes) == self.raw)
        except KeyError:  # a key that was set has been deleted
            return False


def _nothing(_: object) -> tuple[()]:
    return ()


def _copied(picked: Any, count: int) -> Any:
    """``picked`` (one value, or a tuple of ``count`` values) with each list copied, so that an
    append to ``app.conf.redlock_masters`` is a change too."""
    if count == 1:
        return list(picked) if isinstance(picked, list) else picked
    return tuple(list(v) if isinstance(v, list) else v for v in picked)


_cache: dict[int, _Entry] = {}
_cache_lock = threading.Lock()


def app_settings_and_redlock(app: Any) -> tuple[RedlockSettings, Redlock]:
    """The settings and this process's :class:`Redlock` for ``app``, built on first use and
    rebuilt when ``app.conf``'s ``redlock_*`` values change (see the module docstring).

    A forked child (a prefork pool's process) starts with an empty cache and builds its own, so
    connections are never inherited. A change to a bad value raises :class:`ConfigError` at
    every call until it is corrected; the settings read before are not used meanwhile.
    """
    entry = _cache.get(id(app))  # no lock on the hot path: a dict look-up is atomic
    if entry is not None and entry.current(app.conf):
        return entry.settings, entry.redlock
    with _cache_lock:
        entry = _cache.get(id(app))
        conf = app.conf
        if entry is not None and entry.current(conf):
            return entry.settings, entry.redlock
        built = _build(app, conf, entry)
        _cache[id(app)] = built
    if entry is not None and built.redlock is not entry.redlock:
        # Closes the old Redlock's idle links. A lock still
        # held on it keeps it (Lock.redlock): its extensions and release go to the masters that
        # granted it, on new links.
        entry.redlock.close()
    return built.settings, built.redlock


def _build(app: Any, conf: Any, old: _Entry | None) -> _Entry:
    app_name = getattr(app, "main", app)
    conf.get("redlock_masters")  # a Celery conf still pending is loaded by its first read
    refuse_unknown_settings(conf)
    # The snapshot is taken before the read: a write meanwhile makes the next run read again.
    entry = _Entry(conf)
    settings = read_settings(conf)
    if old is None:
        redlock = new_redlock(settings)
        logger.debug("process %d: %r for app %s", pid(), redlock, app_name)
    elif settings == old.settings:
        settings, redlock = old.settings, old.redlock  # the same values: option caches stay valid
    else:
        changed = [
            f.name
            for f in fields(settings)
            if f.compare and getattr(settings, f.name) != getattr(old.settings, f.name)
        ]
        rebuild = any(name in REDLOCK_FIELDS for name in changed)
        redlock = new_redlock(settings) if rebuild else old.redlock
        _log_change(app_name, old.settings, settings, changed)
    entry.settings, entry.redlock = settings, redlock
    return entry


def _log_change(app_name: Any, old: RedlockSettings, new: RedlockSettings, changed: list[str]) -> None:
    described = "; ".join(
        f"{name if name in CELERY_SETTINGS_READ else 'redlock_' + name} "
        f"{getattr(old, name)!r} -> {getattr(new, name)!r}"
        for name in changed
    )
    if "masters" in changed:
        # Exclusion holds only among processes that use the same masters.
        logger.warning(
            "app %s: settings changed after first use in process %d (%s): new locks are taken on "
            "the new masters; locks held on the old ones stay there until released, and nothing "
            "still locking on the old masters excludes what locks on the new",
            app_name,
            pid(),
            described,
        )
    else:
        logger.info(
            "app %s: settings changed after first use in process %d (%s); the next locked runs use them",
            app_name,
            pid(),
            described,
        )


def app_redlock(app: Any) -> Redlock:
    """The :class:`Redlock` this process uses for ``app``'s locked tasks, over its
    ``redlock_*`` settings: for locks a task's body takes itself, such as a service function's
    ``with app_redlock(app).lock("invoice:42", reentrant=True):`` that re-enters the task's own
    lock (``lock_reentrant=True``). Rebuilt when the settings change, like the tasks' own."""
    return app_settings_and_redlock(app)[1]


def close_app_redlock(app: Any | None = None) -> None:
    """Close and forget this process's Redlock (for ``app``, or every app)."""
    with _cache_lock:
        keys = list(_cache) if app is None else [id(app)]
        entries = [_cache.pop(k) for k in keys if k in _cache]
    for entry in entries:
        entry.redlock.close()


def _after_fork_in_child() -> None:
    global _cache_lock
    # The parent's Redlocks are the parent's: dropped, not closed (each Master forgets its
    # parent's connections on its own), so the child builds its own on first use.
    _cache.clear()
    _cache_lock = threading.Lock()  # another thread may have held it at the fork


on_fork_in_child(_after_fork_in_child)
