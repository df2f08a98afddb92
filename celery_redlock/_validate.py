"""The one place numbers (and the few other values) of settings and arguments are checked.

Every knob here ends up in arithmetic that the masters or the clock take literally: a TTL
becomes ``PX`` milliseconds, a timeout a deadline, a delay a sleep, a drift factor a share of
the validity. NaN slips through any check written as ``if value < minimum`` (every comparison
with NaN is false) and infinity through any lower bound; each then fails far from its cause (an
``OverflowError`` when the TTL is packed, a lock no quorum can ever grant, a wait without end).
So non-finite values are refused before the bounds are looked at, and every refusal is a
:class:`ConfigError` that names the setting and shows the bad value.

A bool is refused where a number is wanted although Python counts it as an int: ``ttl=True`` is
a slip, never a TTL of one second.
"""

from __future__ import annotations

import math

from .errors import ConfigError


def number(
    name: str,
    value: object,
    *,
    above: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
    at_most: float | None = None,
    unit: str = "",
    why: str = "",
) -> float:
    """``value`` as a finite float within the bounds given, else a :class:`ConfigError`.

    ``above``/``below`` are exclusive bounds, ``at_least``/``at_most`` inclusive ones. ``unit``
    (e.g. ``"seconds"``) and ``why`` (the reason for a bound) only make the message clearer.
    """
    # type() first: the usual value is a plain float, which needs none of the isinstance checks.
    if type(value) is not float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{name} must be a number{_of_unit(unit)}, got {type(value).__name__} {value!r}")
    try:
        result = float(value)
    except OverflowError:  # an int too large for a float is as unusable as infinity
        result = math.inf
    if not math.isfinite(result):
        raise ConfigError(f"{name} must be a finite number{_of_unit(unit)}, got {value!r}")
    bound = _bound_missed(result, above, at_least, below, at_most)
    if bound is None:
        return result
    raise ConfigError(
        f"{name} must be {bound}{f' {unit}' if unit else ''}{f' ({why})' if why else ''}, got {value!r}"
    )


def _of_unit(unit: str) -> str:
    """The unit as a type error words it: "a number of seconds"."""
    return f" of {unit}" if unit else ""


def _bound_missed(
    result: float, above: float | None, at_least: float | None, below: float | None, at_most: float | None
) -> str | None:
    """The first bound ``result`` misses, as the message words it; None when it keeps them all."""
    # Written as "not (within)", so each test reads as the bound it keeps.
    if above is not None and not result > above:
        return f"> {above}"
    if at_least is not None and not result >= at_least:
        return f">= {at_least}"
    if below is not None and not result < below:
        return f"< {below}"
    if at_most is not None and not result <= at_most:
        return f"at most {at_most}"
    return None


def count(name: str, value: object) -> int:
    """``value`` as an int >= 0 (a number of attempts), else a :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an int >= 0, got {type(value).__name__} {value!r}")
    return int(value)


def choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a :class:`ConfigError` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def flag(name: str, value: object) -> bool:
    """``value`` if it is True or False (not merely truthy), else a :class:`ConfigError`."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def instant(name: str, value: object) -> float:
    """``value`` (an aware ``datetime``, or an ISO 8601 string with its UTC offset) as seconds
    since the epoch, else a :class:`ConfigError`. A local time without its offset is refused:
    which instant it means would depend on the zone of the process reading it."""
    import datetime as dt

    parsed = value
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value)
        except ValueError:
            raise ConfigError(
                f"{name} must be an ISO 8601 time with its UTC offset, such as "
                f"'2024-01-01T00:00:00+00:00', got {value!r}"
            ) from None
    if not isinstance(parsed, dt.datetime):
        raise ConfigError(
            f"{name} must be a datetime or an ISO 8601 string, got {type(value).__name__} {value!r}"
        )
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise ConfigError(
            f"{name} must carry its UTC offset (a local time names no one instant), got {value!r}"
        )
    return parsed.timestamp()


def wait_timeout(name: str, value: object) -> float:
    """How long a blocking acquisition may wait, in seconds: a number >= 0, where ``math.inf``
    and ``-1`` (as ``threading.Lock.acquire`` reads it) mean no limit; else a :class:`ConfigError`.
    NaN and other negative numbers are refused, not read as "forever" or "at once" by accident."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (value == -1 or value == math.inf):
        return math.inf
    return number(name, value, at_least=0, unit="seconds", why="or -1 / math.inf for no limit")
