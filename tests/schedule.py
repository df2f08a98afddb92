"""The order in which ``pytest -n N --dist loadfile`` hands test files to its worker processes:
the longest first, by the times a measured run recorded (``tests/durations.json``).

Why: xdist hands a file to whichever worker runs short of work, in order of the number of tests
per file. A file of one minute-long test (a wait for a crontab boundary, a soak) then comes
last, when the other workers have nothing left, and the run waits for it alone. Handed out
longest first, the last files handed out are short, and the workers finish close together.

This decides only which file goes to which worker when: every test still runs, in its file's
own order (pytest-randomly shuffles within each file, and among files of equal cost). A file the
table does not know costs ``UNKNOWN_TEST_SECONDS`` a test, so a new file is neither first nor
starved. The table is refreshed from a run's JUnit report::

    python -m pytest -n 4 --junitxml=/tmp/junit.xml
    python -m tests.schedule /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

TABLE = Path(__file__).with_name("durations.json")
# What a test of a file the table does not know is taken to cost (about the suite's mean).
UNKNOWN_TEST_SECONDS = 0.5
# Tests shorter than this are left out of the table (they cost UNKNOWN_TEST_SECONDS / 5 each):
# it stays small, and reordering among short files changes nothing.
RECORDED_FROM = 1.0


def load_table(path: Path = TABLE) -> dict[str, dict[str, float]]:
    """{test file: {test id within it: seconds}}; empty when there is no table."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {
        str(file): {str(test): float(seconds) for test, seconds in tests.items()}
        for file, tests in table.items()
    }


def file_cost(table: dict[str, dict[str, float]], scope: str, nodeids: list[str]) -> float:
    """The seconds a file's selected tests are expected to take: their recorded times, and a
    small share for each test too short to be recorded; a file never recorded costs
    ``UNKNOWN_TEST_SECONDS`` a test."""
    known = table.get(scope)
    if known is None:
        return UNKNOWN_TEST_SECONDS * len(nodeids)
    short = UNKNOWN_TEST_SECONDS / 5
    return sum(known.get(nodeid.partition("::")[2], short) for nodeid in nodeids)


class LongestFirstScheduling(LoadFileScheduling):  # type: ignore[misc]
    """xdist's ``loadfile`` scheduling, its queue of files ordered by expected cost, longest
    first (ties keep the collection's order, which pytest-randomly shuffled)."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._table = load_table()
        self._ordered = False

    def _assign_work_unit(self, node: Any) -> None:
        # The queue is filled by schedule() just before its first assignment: order it then, once.
        if not self._ordered:
            units = sorted(
                self.workqueue.items(), key=lambda unit: -file_cost(self._table, unit[0], list(unit[1]))
            )
            self.workqueue.clear()
            self.workqueue.update(units)
            self._ordered = True
        super()._assign_work_unit(node)


def table_from_junit(report: Path, root: Path = TABLE.parent.parent) -> dict[str, dict[str, float]]:
    """{test file: {test id: seconds}} of every test of ``report`` that took ``RECORDED_FROM``
    or more (setup and teardown included, as JUnit reports them by default). A case's
    ``classname`` is its module and class, dotted: the module is its longest prefix that is a
    file under ``root``."""
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for case in ElementTree.parse(report).iter("testcase"):
        seconds = float(case.get("time") or 0)
        if seconds < RECORDED_FROM:
            continue
        parts = (case.get("classname") or "").split(".")
        for cut in range(len(parts), 0, -1):
            file = "/".join(parts[:cut]) + ".py"
            if (root / file).is_file():
                break
        else:
            continue  # not a test file of this tree
        test = "::".join([*parts[cut:], str(case.get("name"))])
        table[file][test] = round(seconds, 1)
    return {file: dict(sorted(tests.items())) for file, tests in sorted(table.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.schedule JUNIT_REPORT.xml", file=sys.stderr)
        return 2
    table = table_from_junit(Path(argv[0]))
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    total = sum(sum(tests.values()) for tests in table.values())
    print(f"{TABLE}: {sum(map(len, table.values()))} tests in {len(table)} files, {total:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
