"""A start-up probe of the masters: which of them do not answer a PING.

A worker whose masters cannot be reached would otherwise go ready without a word and only show
it later, as every locked run retrying. The probe runs once, before the pool starts, and never
on the way to a lock. Each master is asked on a daemon thread of its own, so a master whose name
lookup or connect hangs costs the probe its ``timeout`` and delays no other master; the threads
are joined (or given up on) before the probe returns, so none is left running when a prefork
pool forks, unless a lookup outlives the deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .transport.master import Master


def unanswered(masters: Sequence[Master], timeout: float) -> dict[str, str]:
    """``{master name: why}`` for each master that did not answer a PING within ``timeout``."""
    answers: dict[str, str] = {}
    threads = []
    for master in masters:
        thread = threading.Thread(
            target=_ping, args=(master, timeout, answers), name="redlock-probe", daemon=True
        )
        thread.start()
        threads.append((master, thread))
    deadline = time.monotonic() + timeout
    missing: dict[str, str] = {}
    for master, thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 0.05)
        why = answers.get(master.name, f"no answer within {timeout:g} s")
        if why:
            missing[master.name] = why
    return missing


def _ping(master: Master, timeout: float, answers: dict[str, str]) -> None:
    conn = None
    try:
        conn = master.probe_connection(timeout)
        conn.send_command("PING")
        reply = conn.read_response()
        answers[master.name] = "" if reply in (b"PONG", "PONG", True) else f"answered {reply!r} to PING"
    except Exception as exc:  # any failure is the answer: the probe only reports
        answers[master.name] = f"{type(exc).__name__}: {exc}"
    finally:
        if conn is not None:
            conn.disconnect()
