"""How the operators' commands show a lock and the masters' health as text: the tables and the
sentences under them (:mod:`.commands` decides what to show; this is how it reads)."""

from __future__ import annotations

from ..lock import admin
from .output import Output


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def unanswered(view: admin.LockView) -> list[str]:
    """The masters that did not answer the look at ``view``'s key."""
    return [m.master for m in view.masters if m.kind == "error"]


def _heartbeat(view: admin.LockView) -> str:
    """How often its record says its holder extends it (what ``release`` watches for)."""
    holder = view.holder
    if view.marker:
        return ""
    if holder is None or holder.heartbeat is None:
        return "; no heartbeat interval recorded"
    return f"; extended every {holder.heartbeat:g} s (recorded)"


def print_view(out: Output, view: admin.LockView) -> None:
    """One lock on every master, then whether a quorum holds it and by whom.

    A token is marked ``*`` only when the masters hold different tokens: the mark then tells
    the lock's own token (the one most masters hold) from leftovers of other attempts, and a
    legend under the table says so.
    """
    tokens = {token for m in view.masters for token, _ in m.tokens}
    marked = len(tokens) > 1
    rows = []
    for m in view.masters:
        for token, count in m.tokens:
            mark = ("*" if token == view.token else " ") if marked else ""
            extra = f" x{count}" if m.kind == "reentrant" else ""
            rows.append((m.master, m.kind, f"{mark}{token[: admin.TOKEN_HEX]}{extra}", seconds(m.pttl)))
        if not m.tokens:
            rows.append((m.master, m.kind, m.error or "-", seconds(m.pttl)))
    out.table(("MASTER", "KIND", "TOKEN", "PTTL"), rows)
    if marked:
        out.line("(* marks the lock's token, the one most masters hold; the others are leftovers)")
    holder = "-" if view.token is None else view.describe_holder()
    if view.held:
        out.line(
            f"{view.key}: held on a quorum ({view.agree} of {len(view.masters)} masters, quorum "
            f"{view.quorum}) by {holder}; {seconds(view.ttl_left)} left{_heartbeat(view)}"
        )
    elif len(view.masters) - len(unanswered(view)) < view.quorum:
        # Too few answered to say it is not held: say what was seen, not a verdict.
        out.line(
            f"{view.key}: not seen held ({view.agree} of {len(view.masters)} masters hold one "
            f"token; only {len(view.masters) - len(unanswered(view))} answered, quorum {view.quorum})"
        )
    else:
        out.line(
            f"{view.key}: not held on a quorum ({view.agree} of {len(view.masters)} masters hold "
            f"one token, quorum {view.quorum})"
        )
    if view.queued:
        out.line(f"{view.queued} waiting in its fair queue")


def _health_row(m: admin.MasterHealth) -> tuple[str, ...]:
    """One master's line of the ``health`` table; "-" where the check could not tell."""
    persistence = "-"
    if m.appendonly is not None:
        persistence = f"aof {m.appendfsync or '?'}" if m.appendonly else "none"
    return (
        m.master,
        "up" if m.reachable else "DOWN",
        "-" if m.rtt is None else f"{m.rtt * 1000:.2f} ms",
        "-" if m.version is None else f"{m.server} {m.version}",
        m.role or "-",
        persistence,
        m.maxmemory_policy or "-",
        "-" if m.clock_offset is None else f"{m.clock_offset * 1000:+.1f} ms",
        "-" if m.commands_run is None else ("yes" if m.commands_run else "NO"),
    )


def health_rows(report: admin.Health) -> list[tuple[str, ...]]:
    return [_health_row(m) for m in report.masters]
