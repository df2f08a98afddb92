"""The standalone fault run: every scenario (or the chosen ones), then the figures table.

    python -m tests.faults.run --duration 1800 --seed 7          # the long run: 30 min in all
    python -m tests.faults.run --duration 120 --seed 7 --only partition,clock-fast
    python -m tests.faults.run --duration 240 --seed 7 --only stale-writer,stale-writer-celery

``--duration`` is the total, shared out evenly between the scenarios. The exit status is 1 if a
scenario failed to show what it must (see ``scenarios.py``). Needs Debian's ``faketime`` for
the clock scenarios.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence

from .scenarios import BY_NAME, SCENARIOS, Result, run_scenario

COLUMNS = (
    "scenario",
    "expect",
    "operations",
    "holds",
    "overlaps",
    "lost updates",
    "lost work",
    "fence viol.",
    "lost (fenced)",
    "stale refused",
    "max unavailability",
    "faults",
    "verdict",
)


def table(results: Sequence[Result]) -> str:
    rows = []
    for result in results:
        report = result.report
        unavailable = f"{report.max_unavailable:.2f} s"
        stale = "-"
        if "stale_writer" in result.scenario.faults and result.scenario.fenced:
            refused = report.stale_fenced_refused
            stale = f"{refused} of {refused + report.stale_fenced_accepted}"
        if not result.scenario.available:
            unavailable += " *"
        rows.append(
            (
                result.scenario.name,
                result.scenario.expect,
                str(report.operations),
                str(report.holds),
                str(len(report.overlaps)),
                str(report.lost_updates),
                f"{report.lost_work} of {report.published}" if report.published else "-",
                _fenced(result, str(len(report.fence_violations))),
                _fenced(result, str(report.lost_updates_fenced)),
                stale,
                unavailable,
                str(sum(result.fault_counts.values())),
                "ok" if not result.problems() else "FAILED",
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |" for row in rows]
    return "\n".join(lines)


def _fenced(result: Result, figure: str) -> str:
    """A fence figure, or "-" for a scenario without fenced resources."""
    return figure if result.scenario.fenced else "-"


def details(result: Result) -> str:
    report = result.report
    failures = ", ".join(f"{k} {v}" for k, v in sorted(report.failures.items())) or "none"
    lines = [
        f"## {result.scenario.name}: {result.scenario.summary}",
        f"  failed attempts by reason: {failures}; holds lost before writing: "
        f"{report.lost_holds}; writes: {report.writes}",
        f"  faults: {result.fault_counts or 'none'}",
    ]
    if result.scenario.fenced:
        line = (
            f"  fenced: {report.fenced_holds} holds, {len(report.fence_violations)} fence violations, "
            f"{report.lost_updates_fenced} lost updates, {report.refused} accesses refused"
        )
        if "stale_writer" in result.scenario.faults:
            line += (
                f"; stale writes: plain {report.stale_plain} accepted, fenced "
                f"{report.stale_fenced_refused} refused and {report.stale_fenced_accepted} accepted"
            )
        lines.append(line)
    for overlap in report.overlaps[:3]:
        lines.append(f"  overlap: {overlap}")
    for violation in report.fence_violations[:3]:
        lines.append(f"  fence violation: {violation}")
    if result.scenario.limit:
        lines.append(f"  known limit: {result.scenario.limit}")
    lines += [f"  PROBLEM: {problem}" for problem in result.problems()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=180.0,
        help="total seconds, shared between the scenarios (default 180)",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.CRITICAL)
    names = [n for n in args.only.split(",") if n] or [s.name for s in SCENARIOS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {sorted(BY_NAME)}")
    each = args.duration / len(names)
    results = []
    started = time.monotonic()
    for name in names:
        result = run_scenario(BY_NAME[name], each, args.seed)
        results.append(result)
        print(details(result), flush=True)
    print()
    print(
        f"seed {args.seed}, {each:.0f} s per scenario, {time.monotonic() - started:.0f} s in all; "
        "* = a majority was not always up, availability not asserted"
    )
    print(table(results))
    return 1 if any(r.problems() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
