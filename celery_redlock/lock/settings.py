"""What every Redlock is, whatever carries its commands: the masters, the quorum, the TTL rules
and the tally. :class:`~.redlock.Redlock` (threads) and :class:`~.asyncio.redlock.AsyncRedlock`
(asyncio) both build on :class:`Settings`, so a setting is checked, and a rule computed, once.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from .._validate import choice, count, flag, number
from ..errors import ConfigError
from .tally import Tally
from .transport.commands import Outcome
from .transport.identity import refuse_shared_servers
from .transport.master import Master

logger = logging.getLogger("celery_redlock.redlock")

# The least drift allowed for, whatever the TTL: clock granularity and the scheduling delay
# between a master setting the key and its reply being read.
CLOCK_DRIFT_FLOOR = 0.002
# The longest TTL the servers take (seconds, ~290 million years). ``PX`` and ``PEXPIRE`` take a
# signed 64-bit count of milliseconds, which the server adds to its clock (milliseconds since the
# epoch) and refuses if the sum passes 2**63 - 1 (about 9.2234e18): this leaves room for a clock
# 700,000 years ahead, and is exact as a float and in milliseconds. Above the servers' bound,
# every acquire would fail on every master ("invalid expire time" or "not an integer").
MAX_TTL = 9.2e15
_MAX_TTL_WHY = "the servers count a TTL in milliseconds added to their clock, in 63 bits"
# Warnings are raised from Settings.__init__, which the client classes inherit: one frame up is
# the caller's line.
_CALLER = 2


class RedlockWarning(UserWarning):
    """A configuration that works but weakens the lock's guarantees."""


class Settings:
    """The checked settings of a Redlock and the rules that read them (see ``Redlock``'s
    docstring for each setting). A client class names the transports it has in ``TRANSPORTS``
    (the first is its default) and makes them in ``_open``, which connects nothing yet."""

    TRANSPORTS: tuple[str, ...] = ()

    def __init__(
        self,
        masters: Iterable[str | Any],
        *,
        ttl: float = 30.0,
        retry_count: int = 3,
        retry_delay: float = 0.2,
        drift_factor: float = 0.01,
        request_timeout: float = 0.1,
        key_prefix: str = "redlock:",
        release_linger: float = 0.0,
        wait: str = "release",
        wait_poll: float | None = None,
        fence_retention: float = 86400.0,
        transport: str | None = None,
    ) -> None:
        if isinstance(masters, (str, bytes)):
            masters = [masters]
        try:
            specs = list(masters)
        except TypeError:
            raise ConfigError(
                f"masters must be a list of redis URLs or redis.Redis clients, got "
                f"{type(masters).__name__} {masters!r}"
            ) from None
        if not specs:
            raise ConfigError("masters: at least one master is needed")
        ttl = number("ttl", ttl, above=0, unit="seconds")
        self.retry_count = count("retry_count", retry_count)
        self.retry_delay = number("retry_delay", retry_delay, at_least=0, unit="seconds")
        self.drift_factor = number("drift_factor", drift_factor, at_least=0, below=0.5)
        self.request_timeout = number("request_timeout", request_timeout, above=0, unit="seconds")
        self.min_ttl = _min_ttl(self.request_timeout, self.drift_factor)
        self.ttl = self.check_ttl("ttl", ttl)
        if not isinstance(key_prefix, str):
            raise ConfigError(f"key_prefix must be a str, got {key_prefix!r}")
        self.key_prefix = key_prefix
        if number("release_linger", release_linger, at_least=0, unit="seconds"):
            warnings.warn(
                "release_linger has no effect: a release waits for the masters' replies",
                DeprecationWarning,
                stacklevel=_CALLER,
            )

        self.wait = choice("wait", wait, ("release", "poll"))
        self.wait_poll = number(
            "wait_poll",
            max(0.5, self.request_timeout) if wait_poll is None else wait_poll,
            at_least=self.request_timeout,
            unit="seconds",
            why="at least request_timeout: a fallback try must have time to finish",
        )

        # How long a name's fence counter outlives its last fenced grant (see fencing.py): once it
        # has expired, the clock floor is a whole retention past the last fence recorded.
        self.fence_retention = number(
            "fence_retention", fence_retention, above=0, at_most=MAX_TTL, unit="seconds", why=_MAX_TTL_WHY
        )
        if self.fence_retention < 3600:
            message = (
                f"fence_retention {self.fence_retention:g} s is under an hour: a counter that expires "
                "falls back to a master's clock, which may be behind the clock that issued the last fence"
            )
            warnings.warn(message, RedlockWarning, stacklevel=_CALLER)

        self.masters: list[Master] = [Master.from_spec(s, self.request_timeout) for s in specs]
        refuse_shared_servers(self.masters)
        if len(self.masters) % 2 == 0:
            message = (
                f"masters: {len(self.masters)} is even; a quorum of {len(self.masters) // 2 + 1} "
                f"tolerates no more failures than {len(self.masters) - 1} masters would"
            )
            warnings.warn(message, RedlockWarning, stacklevel=_CALLER)
            logger.warning(message)
        self.quorum = len(self.masters) // 2 + 1
        # Outcomes to votes, for every kind of lock (lock/tally.py).
        self.tally = Tally([m.name for m in self.masters])
        self.transport_kind = choice(
            "transport", self.TRANSPORTS[0] if transport is None else transport, self.TRANSPORTS
        )
        self._open()

    def _open(self) -> None:
        """Make what carries the commands (``self.transport_kind``), connecting nothing yet."""
        raise NotImplementedError

    def drift(self, ttl: float) -> float:
        return ttl * self.drift_factor + CLOCK_DRIFT_FLOOR

    def check_ttl(self, name: str, value: object) -> float:
        """``value`` as a TTL this Redlock can honour (at least :attr:`min_ttl`, at most
        :data:`MAX_TTL`), else a :class:`ConfigError` that names the bound and what it follows from."""
        if type(value) is float and 0 < self.min_ttl <= value <= MAX_TTL:
            # The usual TTL, checked on every lock made: a plain float in range (never a NaN, which
            # fails both comparisons) is what number() would return, without its calls. min_ttl
            # is always above 0 (see _min_ttl); the first comparison keeps number()'s own bound
            # should anyone set it lower by hand.
            return value
        ttl = number(name, value, above=0, at_most=MAX_TTL, unit="seconds", why=_MAX_TTL_WHY)
        if ttl < self.min_ttl:
            raise ConfigError(
                f"{name} must be at least {self.min_ttl:g} seconds, got {value!r}: a round may take up "
                f"to request_timeout ({self.request_timeout:g} s) and the drift allowance is "
                f"ttl * drift_factor ({self.drift_factor:g}) + {CLOCK_DRIFT_FLOOR * 1000:g} ms, so a "
                "shorter TTL could be granted by every master and still leave no validity"
            )
        return ttl

    def _free_at(self, outcomes: Sequence[Outcome], t_end: float) -> float:
        """When a quorum of masters could have let the key expire, at the earliest: a master
        that granted counts as free now (its grant is retracted), one that answered a PTTL
        as free by then (it ran the script before ``t_end``), any other never."""
        remaining = []
        for outcome in outcomes:
            value = outcome.value if outcome.kind == "ok" else None
            if isinstance(value, list) and value:
                value = value[0]  # a fair lock's refusal: [pttl, ...]
            if value == b"OK":
                remaining.append(0.0)
            elif isinstance(value, int) and value >= 0:
                remaining.append(value / 1000)
            else:  # an error, a timeout, or a key with no TTL (-1)
                remaining.append(math.inf)
        remaining.sort()
        return t_end + remaining[self.quorum - 1] + 0.001


def _min_ttl(request_timeout: float, drift_factor: float) -> float:
    """The least TTL a round can honour, rounded up to the millisecond the masters count in.

    A round counts only the replies that arrive within ``request_timeout``, so a round that
    gathered its quorum in time took less than that. Its validity,
    ``ttl - elapsed - (ttl * drift_factor + CLOCK_DRIFT_FLOOR)``, is then positive for every such
    round iff ``ttl * (1 - drift_factor) >= CLOCK_DRIFT_FLOOR + request_timeout``. Below that,
    every master could grant a lock (or an extension) that is already worth nothing, and the
    holder could not tell a slow round from a lost lock. A round that must first connect takes
    longer still, which is why a TTL should be far above this minimum, not at it.
    """
    raw = (CLOCK_DRIFT_FLOOR + request_timeout) / (1 - drift_factor)
    return math.ceil(raw * 1000 - 1e-9) / 1000


def lock_kind(*, reentrant: object, fair: object, fenced: object) -> str:
    """Which lock ``lock()``'s flags ask for: "fenced", "fair", "reentrant" or "plain". A flag that
    is not True or False, or a fenced or fair lock asked to be another kind too, is a
    :class:`ConfigError` (the masters hold each kind in its own form)."""
    is_reentrant, is_fair, is_fenced = (
        flag("reentrant", reentrant),
        flag("fair", fair),
        flag("fenced", fenced),
    )
    if is_fenced:
        if is_reentrant or is_fair:
            raise ConfigError("fenced=True cannot be combined with reentrant=True or fair=True")
        return "fenced"
    if is_fair:
        if is_reentrant:
            raise ConfigError("fair=True cannot be combined with reentrant=True")
        return "fair"
    return "reentrant" if is_reentrant else "plain"
