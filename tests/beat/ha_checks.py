"""The HA checks of ``test_ha.py``, run again over each wrapped scheduler with shared state.

The caller starts the beats (with the wrapped scheduler configured) and says how to find doubled
sends: by the slot stamp each message carries where every send is stamped with its scheduled slot
(``stamp_doubles``), by epoch-aligned slot of the send time (``aligned_doubles``), or, where an
interval counts from the previous send (redbeat), by two sends closer than half a period
(``interval_doubles``).
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from celery_redlock import Redlock

from .conftest import Beats, Records, count_slots, current_leader, slot_of, wait_until
from .test_ha import PERIOD, SLACK, STANDBY, TTL, leader_pid, new_leader, wait_sends

Sends = list[dict[str, Any]]
Doubles = Callable[[Sends], list[Any]]


def aligned_doubles(sends: Sends) -> list[int]:
    """Slots (multiples of PERIOD since the epoch) sent more than once."""
    if not sends:
        return []
    slots = [slot_of(s["t"]) for s in sends]
    doubled, _ = count_slots(sends, min(slots), max(slots))
    return doubled


def stamp_doubles(sends: Sends) -> list[str]:
    """Slot stamps carried by more than one send. The stamp is the slot the send was scheduled
    for, so a send a loaded machine made late, in the next period, still counts for its own slot
    (by send time it would look like a double of the next one). An unstamped send counts under
    "None", so two of them show up too."""
    counts = Counter(str(s.get("slot")) for s in sends)
    return sorted(stamp for stamp, n in counts.items() if n > 1)


def stamped_slot(send: dict[str, Any]) -> int | None:
    """The slot (a multiple of PERIOD since the epoch) a send's stamp names; None if unstamped."""
    stamp = send.get("slot")
    if not stamp:
        return None
    return round(datetime.datetime.fromisoformat(str(stamp)).timestamp() / PERIOD)


def interval_gaps(sends: Sends) -> list[float]:
    times = sorted(s["t"] for s in sends)
    return [b - a for a, b in itertools.pairwise(times)]


def interval_doubles(sends: Sends) -> list[float]:
    """Gaps between consecutive sends shorter than half a period: one period sent twice."""
    return [round(gap, 3) for gap in interval_gaps(sends) if gap < PERIOD / 2]


def check_sigkill_failover(
    beats: Beats, records: Records, redlock: Redlock, label: str, doubles: Doubles
) -> None:
    """SIGKILL the leader: a standby takes over within TTL + one standby tick, sends within one
    more period, nothing is doubled, and the dead leader sent nothing after the kill."""
    old = leader_pid(redlock, beats)
    wait_sends(records, old, 2, timeout=10)

    killed_at = time.time()
    beats.by_pid(old).kill()
    new, elected_at = new_leader(redlock, old, timeout=TTL + STANDBY + 10)
    wait_sends(records, new, 3, timeout=10)

    sent = records.sent()
    first_new = min(s["t"] for s in sent if s["pid"] == new)
    doubled = doubles(sent)
    print(
        f"\n[beat] {label} SIGKILL failover: elected {elected_at - killed_at:.2f} s, first send "
        f"{first_new - killed_at:.2f} s after the kill (bound {TTL + STANDBY:.1f} s + one "
        f"{PERIOD:.0f} s period); doubled {len(doubled)}"
    )
    assert doubled == []
    assert elected_at - killed_at <= TTL + STANDBY + SLACK
    assert first_new - killed_at <= TTL + STANDBY + PERIOD + SLACK
    assert not [s for s in sent if s["pid"] == old and s["t"] > killed_at]


def check_sigstop(beats: Beats, records: Records, redlock: Redlock, label: str, doubles: Doubles) -> None:
    """SIGSTOP the leader past its TTL: a standby takes over; once resumed, the old leader finds
    its lock lost, sends nothing, and stays a standby; nothing is doubled."""
    old = leader_pid(redlock, beats)
    wait_sends(records, old, 2, timeout=10)
    paused = beats.by_pid(old)

    paused_at = time.time()
    paused.pause()
    new, elected_at = new_leader(redlock, old, timeout=TTL + STANDBY + 10)
    wait_sends(records, new, 2, timeout=10)
    # The pause outlasts the TTL (a new leader can be elected up to TTL/3 sooner: the TTL counts
    # from the last extension before the pause).
    wait_until(lambda: time.time() - paused_at > TTL, TTL + 1, "the pause to outlast the TTL")

    resumed_at = time.time()
    paused.resume()
    paused.wait_for_log(r"beat leader lock \S+ lost", timeout=TTL + 5)
    wait_sends(records, new, 3, timeout=10, after=resumed_at)

    sent = records.sent()
    late = [s for s in sent if s["pid"] == old and s["t"] > paused_at]
    doubled = doubles(sent)
    print(
        f"\n[beat] {label} SIGSTOP {resumed_at - paused_at:.1f} s (TTL {TTL:.0f} s): standby elected "
        f"{elected_at - paused_at:.2f} s after the pause; old leader sent {len(late)} after it, "
        f"doubled {len(doubled)}"
    )
    assert late == []
    assert doubled == [], [
        (s["pid"], round(s["t"], 3), s.get("slot")) for s in sorted(sent, key=lambda s: s["t"])
    ]
    record = current_leader(redlock)
    assert record is not None and record["pid"] == new
