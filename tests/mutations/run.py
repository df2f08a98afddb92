"""Plant each known bug in a copy of the tree and check that the tests meant to catch it do.

    python -m tests.mutations.run                  # every mutant, then the table
    python -m tests.mutations.run --only NAME      # one mutant (repeatable)
    python -m tests.mutations.run --list           # the mutants, their edits' state, their tests

The mutants are data, in :mod:`tests.mutations.mutants`: exact text replacements in the library
and the pytest node ids that must fail under them. For each mutant the working tree (every file
git lists as tracked or as untracked and not ignored, uncommitted edits included) is copied to a
temporary directory, the mutant's edits are applied there (an ``old`` text found other than
exactly once makes the mutant *stale*), and its tests run with pytest in the copy, one mutant at
a time, with ``PYTHONPATH`` naming the copy; the test process refuses to start unless
``celery_redlock`` is imported from the copy. The checkout is never written to and nothing is
installed.

First the selected mutants' tests run once on an unmutated copy (the baseline): a test that
fails without the bug proves nothing with it. Then the table: mutant | what it breaks | tests |
caught? (``killed`` when the tests failed) | seconds.

Exit status 1 if the baseline fails, or any mutant survives, is stale or could not be run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from .mutants import MUTANTS, Edit, Mutant

ROOT = Path(__file__).resolve().parents[2]
# The tests of one mutant take well under a minute; a run past this is stopped and reported.
RUN_TIMEOUT = 300.0
# pytest's own arguments for every run: stop at the first failure (a kill needs one), in order.
PYTEST_ARGS = ("-q", "-x", "-p", "no:randomly")
# Run in the test process before pytest: the package must come from the copy, never the checkout.
BOOTSTRAP = textwrap.dedent(
    """
    import os, sys
    import celery_redlock
    root = os.path.realpath(os.getcwd())
    found = os.path.realpath(celery_redlock.__file__)
    if not found.startswith(root + os.sep):
        sys.stderr.write(f"celery_redlock was imported from {found}, not from the copy {root}\\n")
        sys.exit(99)
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
    """
)
WRONG_PACKAGE = 99


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # killed, SURVIVED, STALE, ERROR
    seconds: float = 0.0
    detail: str = ""  # the first failing test, or why the mutant is stale or errored


def tree_files(root: Path) -> list[str]:
    """The working tree's files, as git sees them (tracked, or untracked and not ignored)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (root / name).is_file()})


def copy_tree(root: Path, files: list[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)


def stale_reason(edits: tuple[Edit, ...], base: Path) -> str:
    """Why the edits cannot be applied to the files under ``base`` ("" if they can)."""
    for edit in edits:
        path = base / edit.path
        if not path.is_file():
            return f"{edit.path}: no such file"
        found = path.read_text().count(edit.old)
        if found != 1:
            first = edit.old.strip().splitlines()[0] if edit.old.strip() else edit.old
            return f"{edit.path}: {first!r} found {found} times"
    return ""


def _child_env() -> dict[str, str]:
    """The environment of a pytest this runner starts: its own run, so without the caller's
    PYTHONPATH and PYTEST_ADDOPTS (CI's --randomly-seed, --junitxml and --durations are for the
    suite's run; with ``-p no:randomly`` the seed option is unknown and collection fails)."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTEST_ADDOPTS")}


def unknown_tests(mutants: list[Mutant], base: Path) -> dict[str, list[str]]:
    """The test ids each mutant names that pytest does not collect under ``base`` (a test
    renamed, or given a parameter, since): a mutant whose tests cannot run proves nothing."""
    named = sorted({test for mutant in mutants for test in mutant.tests})
    files = sorted({test.split("::")[0] for test in named})
    env = _child_env()
    env["PYTHONPATH"] = str(base)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", *files],
        cwd=base,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = [line.strip() for line in done.stdout.splitlines() if "::" in line]

    def found(test: str) -> bool:  # a file, a test (all its parameters) or one parametrized id
        return any(c == test or c.startswith(test + "[") or c.startswith(test + "::") for c in collected) or (
            "::" not in test and (base / test).is_file()
        )

    missing = {mutant.name: [test for test in mutant.tests if not found(test)] for mutant in mutants}
    return {name: tests for name, tests in missing.items() if tests}


def apply(edits: tuple[Edit, ...], base: Path) -> None:
    for edit in edits:
        path = base / edit.path
        path.write_text(path.read_text().replace(edit.old, edit.new, 1))


def run_tests(copy: Path, tests: tuple[str, ...], log: Path, timeout: float) -> tuple[int | None, float]:
    """pytest on ``tests`` in ``copy``; (its exit status, or None if stopped at ``timeout``;
    seconds taken). Its output goes to ``log``."""
    env = _child_env()
    env["PYTHONPATH"] = str(copy)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    command = [sys.executable, "-c", BOOTSTRAP, *PYTEST_ARGS, *tests]
    started = time.monotonic()
    with log.open("wb") as out:
        # A session of its own, so a run stopped at the timeout is stopped whole.
        process = subprocess.Popen(
            command,
            cwd=copy,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            status: int | None = process.wait(timeout)
        except subprocess.TimeoutExpired:
            status = None
            stop(process)
        except BaseException:  # Ctrl-C reaches only this process: the run's session is its own
            stop(process)
            raise
    return status, time.monotonic() - started


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the pytest plugin then stops the servers it started), then SIGKILL."""
    for signum, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def first_failure(log: Path) -> str:
    text = log.read_text(errors="replace")
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    return match.group(1) if match else ""


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def judge(mutant: Mutant, status: int | None, seconds: float, log: Path) -> Outcome:
    if status is None:
        return Outcome(mutant, "killed", seconds, f"stopped after {seconds:.0f} s: the tests hung")
    if status == 1:
        return Outcome(mutant, "killed", seconds, first_failure(log))
    if status == 0:
        return Outcome(mutant, "SURVIVED", seconds)
    why = (
        "celery_redlock imported from outside the copy"
        if status == WRONG_PACKAGE
        else f"pytest exit {status}"
    )
    return Outcome(mutant, "ERROR", seconds, f"{why}\n{tail(log)}")


def fresh_copy(tree: Path, scratch: Path, prefix: str) -> Path:
    """A copy of the snapshot ``tree`` of its own, to change and run in."""
    copy = Path(tempfile.mkdtemp(prefix=prefix, dir=scratch)) / "tree"
    shutil.copytree(tree, copy, symlinks=True)
    return copy


def run_mutant(mutant: Mutant, tree: Path, scratch: Path, timeout: float) -> Outcome:
    copy = fresh_copy(tree, scratch, f"{mutant.name}-")
    try:
        reason = stale_reason(mutant.edits, copy)
        if reason:
            return Outcome(mutant, "STALE", 0.0, reason)
        if not mutant.tests:
            return Outcome(mutant, "ERROR", 0.0, "no tests named")
        apply(mutant.edits, copy)
        log = scratch / f"{mutant.name}.log"
        status, seconds = run_tests(copy, mutant.tests, log, timeout)
        return judge(mutant, status, seconds, log)
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)


def baseline(mutants: list[Mutant], tree: Path, scratch: Path, timeout: float) -> bool:
    """The selected mutants' tests on an unmutated copy; True if they all pass."""
    tests = tuple(dict.fromkeys(test for mutant in mutants for test in mutant.tests))
    if not tests:
        return True
    copy = fresh_copy(tree, scratch, "baseline-")
    try:
        log = scratch / "baseline.log"
        status, seconds = run_tests(copy, tests, log, timeout * max(1, len(mutants)))
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)
    print(f"baseline: {len(tests)} tests, unmutated, {seconds:.1f} s: ", end="")
    if status == 0:
        print("passed")
        return True
    print(f"FAILED (exit {status})\n{tail(log)}")
    return False


def table(outcomes: list[Outcome]) -> str:
    headers = ("mutant", "what it breaks", "tests", "caught?", "seconds")
    rows: list[tuple[str, ...]] = []
    for outcome in outcomes:
        tests = [test.removeprefix("tests/") for test in outcome.mutant.tests] or ["-"]
        seconds = f"{outcome.seconds:.1f}" if outcome.seconds else "-"
        rows.append((outcome.mutant.name, outcome.mutant.breaks, tests[0], outcome.verdict, seconds))
        rows += [("", "", test, "", "") for test in tests[1:]]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    rule = "-+-".join("-" * width for width in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations.run", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run this mutant (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and whether they apply")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per mutant's tests")
    args = parser.parse_args(argv)

    known = {mutant.name: mutant for mutant in MUTANTS}
    unknown = [name for name in args.only or () if name not in known]
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}; --list shows them")
    chosen = [known[name] for name in args.only] if args.only else list(MUTANTS)

    if args.list:
        missing = unknown_tests(chosen, ROOT)
        stale = False
        for mutant in chosen:
            reason = stale_reason(mutant.edits, ROOT)
            if mutant.name in missing:
                reason = (
                    (reason + "; " if reason else "") + "no such test: " + ", ".join(missing[mutant.name])
                )
            stale = stale or bool(reason)
            print(f"{mutant.name}: {mutant.breaks}{'  [STALE: ' + reason + ']' if reason else ''}")
            for test in mutant.tests:
                print(f"    {test}")
        return 1 if stale else 0

    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="redlock-mutations-") as scratch_dir:
        scratch = Path(scratch_dir)
        # One snapshot of the working tree, taken now: the baseline and every mutant start from
        # the same code, whatever is edited in the checkout meanwhile.
        tree = scratch / "snapshot"
        copy_tree(ROOT, tree_files(ROOT), tree)
        if not args.no_baseline and not baseline(chosen, tree, scratch, args.timeout):
            return 1
        outcomes = []
        for mutant in chosen:
            outcome = run_mutant(mutant, tree, scratch, args.timeout)
            print(f"{mutant.name}: {outcome.verdict} ({outcome.seconds:.1f} s)", flush=True)
            outcomes.append(outcome)
    print()
    print(table(outcomes))
    details = [o for o in outcomes if o.detail]
    if details:
        print()
        for outcome in details:
            label = "killed by" if outcome.verdict == "killed" else outcome.verdict
            print(f"{outcome.mutant.name}: {label} {outcome.detail}")
    caught = sum(1 for o in outcomes if o.verdict == "killed")
    print(f"\n{caught} of {len(outcomes)} mutants caught in {time.monotonic() - began:.0f} s")
    return 0 if caught == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
