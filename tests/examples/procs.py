"""What is still alive, read from /proc: a test's proof that a command left nothing behind."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

PID_LINE = re.compile(r"\bpid (\d+)\b")


def printed_pids(output: str) -> set[int]:
    """Every ``pid N`` a command reported starting."""
    return {int(p) for p in PID_LINE.findall(output)}


def survivors(pids: Iterable[int]) -> list[str]:
    """Live (non-zombie) processes that are one of ``pids`` or in one of their process groups.

    Every process the demo starts leads a session of its own, so its process group holds it and
    everything it forked (a worker's pool children included).
    """
    wanted = set(pids)
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: split after the last ')'.
        head, _, rest = stat.rpartition(")")
        fields = rest.split()
        state, pgrp = fields[0], int(fields[2])
        pid = int(entry.name)
        if state != "Z" and (pid in wanted or pgrp in wanted):
            alive.append(f"{pid} ({head.partition('(')[2]}) state {state} group {pgrp}")
    return alive
