"""Every numeric option refuses NaN, infinity, bools and strings, at the place it is given.

NaN passes any check written as ``value < minimum`` and infinity any lower bound; before the
one validation helper, ``Redlock(ttl=nan)`` failed with a raw OverflowError at the first acquire,
``request_timeout=inf`` made a lock no quorum could grant in time, and ``acquire(timeout=nan)``
waited without end. Each case here must fail at once with a ConfigError that names the option.

Constructing a Redlock sends nothing (port 1: nobody listens), so most of these need no server.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_redlock import ConfigError, Redlock, RedlockTask
from celery_redlock.celery.beat import BeatSettings
from celery_redlock.celery.settings import read_settings
from celery_redlock.celery.slots import slot_time
from celery_redlock.lock.heartbeat import Heartbeat

from .conftest import take

NOWHERE = ["redis://127.0.0.1:1/0"]

NAN, INF = float("nan"), float("inf")
# (the bad value, what the message must say about it)
BAD_NUMBERS: list[tuple[object, str]] = [
    (NAN, "finite"),
    (INF, "finite"),
    (-INF, "finite"),
    (10**400, "finite"),  # an int no float can hold
    (True, "bool"),
    ("1", "str"),
]
# A wait timeout reads math.inf (and -1) as "no limit" (tests/core/test_waiting.py); the rest is bad.
BAD_TIMEOUTS = [(value, says) for value, says in BAD_NUMBERS if value != INF]
# Counts are ints: a float of any kind is refused for its type.
BAD_COUNTS: list[tuple[object, str]] = [
    (NAN, "float"),
    (INF, "float"),
    (-INF, "float"),
    (True, "bool"),
    ("1", "str"),
]


def _cases(options: list[str], bad: list[tuple[object, str]]) -> list[Any]:
    return [
        pytest.param(option, value, says, id=f"{option}={value!r}"[:40])
        for option in options
        for value, says in bad
    ]


def refused(call: Callable[[], object], option: str, says: str) -> None:
    """``call`` raises a ConfigError naming ``option`` and saying ``says`` about the value."""
    with pytest.raises(ConfigError, match=re.escape(option)) as caught:
        call()
    assert says in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        *_cases(["ttl", "retry_delay", "drift_factor", "request_timeout", "release_linger"], BAD_NUMBERS),
        *_cases(["retry_count"], BAD_COUNTS),
    ],
)
def test_redlock_options(option: str, value: object, says: str) -> None:
    refused(lambda: Redlock(NOWHERE, **{option: value}), option, says)


@pytest.mark.parametrize(
    ("option", "value", "says"), [*_cases(["ttl"], BAD_NUMBERS), *_cases(["timeout"], BAD_TIMEOUTS)]
)
def test_lock_options(option: str, value: object, says: str) -> None:
    redlock = Redlock(NOWHERE)
    refused(lambda: redlock.lock("x", **{option: value}), option, says)


@pytest.mark.parametrize(("option", "value", "says"), _cases(["timeout"], BAD_TIMEOUTS))
def test_acquire_timeout(option: str, value: object, says: str) -> None:
    lock = Redlock(NOWHERE, retry_delay=0).lock("x")
    refused(lambda: lock.acquire(timeout=value), option, says)  # type: ignore[arg-type]
    assert lock.last_votes == []  # refused before anything was sent


@pytest.mark.parametrize(("option", "value", "says"), _cases(["ttl"], BAD_NUMBERS))
def test_extend_ttl(option: str, value: object, says: str) -> None:
    lock = Redlock(NOWHERE).lock("x")
    refused(lambda: lock.extend(ttl=value), option, says)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-2, -0.5, -1.0000001])
def test_negative_timeout_other_than_minus_one_is_refused(value: float) -> None:
    lock = Redlock(NOWHERE).lock("x")
    refused(lambda: lock.acquire(timeout=value), "timeout", ">= 0")


NUMERIC_SETTINGS = [
    "redlock_ttl",
    "redlock_request_timeout",
    "redlock_drift_factor",
    "redlock_heartbeat_interval",
    "redlock_retry_backoff",
    "redlock_retry_backoff_max",
    "redlock_wait_timeout",
]


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        *_cases(NUMERIC_SETTINGS, BAD_NUMBERS),
        *_cases(["redlock_max_retries"], BAD_COUNTS),
    ],
)
def test_celery_settings(option: str, value: object, says: str) -> None:
    conf = {"redlock_masters": NOWHERE, option: value}
    refused(lambda: read_settings(conf), option, says)


def test_good_celery_settings_are_read_as_floats() -> None:
    settings = read_settings(
        {"redlock_masters": NOWHERE, "redlock_ttl": 5, "redlock_max_retries": 3, "redlock_retry_backoff": 0}
    )
    assert settings.ttl == 5.0 and isinstance(settings.ttl, float)
    assert settings.max_retries == 3 and settings.retry_backoff == 0.0
    assert settings.heartbeat_interval is None


@pytest.mark.parametrize(
    ("option", "value", "says"),
    _cases(
        [
            "lock_ttl",
            "lock_retry_backoff",
            "lock_retry_backoff_max",
            "lock_heartbeat_interval",
            "lock_max_hold",
            "lock_wait_timeout",
        ],
        BAD_NUMBERS,
    ),
)
def test_task_options(option: str, value: object, says: str) -> None:
    app = Celery("validation", set_as_current=False)

    def define() -> None:
        @app.task(base=RedlockTask, name="validation.job", lazy=False, shared=False, **{option: value})
        def job() -> None: ...

    refused(define, f"'validation.job': {option}", says)


@pytest.mark.parametrize(
    ("option", "value", "says"),
    _cases(
        ["redlock_beat_lock_ttl", "redlock_beat_min_validity", "redlock_beat_standby_interval"], BAD_NUMBERS
    ),
)
def test_beat_settings(option: str, value: object, says: str) -> None:
    refused(lambda: BeatSettings.from_conf({option: value}), option, says)


@pytest.mark.parametrize("period", [NAN, INF, 0.0, -60.0])
def test_slot_period(period: float) -> None:
    refused(
        lambda: slot_time(period, 1_700_000_000.0),
        "lock_slot interval",
        "finite" if not math.isfinite(period) else "> 0",
    )


@pytest.mark.parametrize(("option", "value", "says"), _cases(["interval", "max_hold"], BAD_NUMBERS))
def test_heartbeat_keep(rl: Redlock, option: str, value: object, says: str) -> None:
    heartbeat = Heartbeat()
    lock = rl.lock("validation-heartbeat", ttl=5)
    assert take(lock), lock.last_error
    try:
        refused(lambda: heartbeat.keep(lock, **{option: value}), option, says)
        assert heartbeat.kept() == []
    finally:
        lock.release()
        heartbeat.stop()


def test_bounds_keep_their_messages() -> None:
    # Messages that operators' runbooks and the docs quote.
    refused(lambda: Redlock(NOWHERE, ttl=0), "ttl", "must be > 0")
    refused(lambda: Redlock(NOWHERE, drift_factor=0.5), "drift_factor", "must be < 0.5")
    refused(lambda: Redlock(NOWHERE, release_linger=-1), "release_linger", "must be >= 0")
    refused(lambda: Redlock(NOWHERE, retry_count=-1), "retry_count", "must be an int >= 0")
    refused(
        lambda: read_settings({"redlock_masters": NOWHERE, "redlock_contended": "sometimes"}),
        "redlock_contended",
        "must be one of",
    )
