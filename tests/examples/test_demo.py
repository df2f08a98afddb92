"""``python -m celery_redlock demo``: the README's first command, run as a user runs it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from celery_redlock.demo.ledger import LedgerReader, LedgerWriter, summarize
from celery_redlock.demo.run import burst

from .procs import printed_pids, survivors

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}


def _row(output: str, name: str) -> str:
    match = re.search(rf"{re.escape(name)}\s*[│|]\s*(.+?)\s*[│|]", output)
    assert match, f"no row {name!r} in:\n{output}"
    return match.group(1)


def _assert_nothing_left(output: str, expected: int) -> None:
    pids = printed_pids(output)
    assert len(pids) == expected, output  # 5 masters, a broker, 2 workers
    deadline = time.monotonic() + 10
    while survivors(pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # pool children orphaned by a killed worker are reaped asynchronously
    assert survivors(pids) == []


@pytest.mark.timeout(150)
def test_demo_runs_a_duplicate_burst_without_overlap_through_a_master_kill() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "celery_redlock", "demo", "--tasks", "200", "--invoices", "20", "--seed", "7"],
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert _row(out, "tasks submitted") == "200"
    assert _row(out, "tasks finished") == "200"
    assert _row(out, "bodies run") == "200"  # retry policy: every duplicate runs, in turn
    assert int(_row(out, "duplicates that waited (retried)")) > 0
    assert _row(out, "overlaps found by the checker") == "0"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", _row(out, "master killed mid-burst"))
    assert re.fullmatch(r"\d+\.\d ms", _row(out, "lock acquire latency p99"))
    _assert_nothing_left(out, expected=8)


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_process_the_demo_started() -> None:
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery_redlock",
            "demo",
            "--tasks",
            "5000",
            "--invoices",
            "50",
            "--deadline",
            "90",
        ],
        cwd=tempfile.gettempdir(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:  # bounded by the test's timeout; the demo prints as it goes
            lines.append(line)
            if line.startswith("submitted "):
                break
        assert lines and lines[-1].startswith("submitted "), "".join(lines)
        demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    out = "".join(lines) + rest
    assert demo.returncode == 130, out
    assert "interrupted (SIGINT)" in out
    _assert_nothing_left(out, expected=8)


def test_the_summary_counts_each_event_and_names_the_overlapping_runs(tmp_path: Path) -> None:
    writer = LedgerWriter(tmp_path)
    runs = [
        ("a", "invoice:1", 0.0, 1.0),
        ("b", "invoice:1", 1.0, 2.0),  # back to back: fine
        ("c", "invoice:1", 1.5, 1.7),  # inside b: overlap
        ("d", "invoice:2", 0.5, 1.5),
    ]  # other resource
    for task_id, resource, start, end in runs:
        writer.write("run", task_id=task_id, resource=resource, start=start, end=end, acquire=0.001)
        writer.write("done", task_id=task_id, state="SUCCESS")
    writer.write("retry", task_id="e")
    writer.write("done", task_id="e", state="RETRY")
    writer.write("done", task_id="e", state="SUCCESS")  # the retried run ended without a body
    reader = LedgerReader(tmp_path)
    reader.poll()
    summary = summarize(reader, submitted=5)
    assert [(a.task_id, b.task_id) for a, b in summary.overlaps] == [("b", "c")]
    assert (summary.finished, summary.ran, summary.waited, summary.skipped) == (5, 4, 1, 1)
    assert not summary.ok


def test_burst_holds_every_invoice_and_clusters_duplicates() -> None:
    import itertools
    import random

    ids = burst(300, 30, random.Random(1))
    assert sorted(ids) == sorted(i % 30 + 1 for i in range(300))
    adjacent = sum(1 for a, b in itertools.pairwise(ids) if a == b)
    assert adjacent > 50  # copies of one call arrive close together, as duplicates do


@pytest.mark.timeout(120)
def test_demo_uses_the_masters_and_broker_it_is_given(redlock_master_urls: list[str]) -> None:
    from celery_redlock.testing import RedisServer

    with RedisServer() as broker:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery_redlock",
                "demo",
                "--masters",
                ",".join(redlock_master_urls),
                "--broker",
                broker.url,
                "--tasks",
                "40",
                "--invoices",
                "8",
                "--work",
                "0.02",
            ],
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
            timeout=100,
            env=_env(),
        )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "real masters given: not killing one" in out
    assert not re.search(r"^(master|broker) ", out, re.M)  # started none of its own
    assert _row(out, "bodies run") == "40"
    _assert_nothing_left(out, expected=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "5", "--invoices", "10"], "--tasks (5) must be at least --invoices (10)"),
        (["--workers", "0"], "Invalid value for '--workers': 0 is not in the range x>=1"),
        (["--masters", ","], "Invalid value for '--masters': no master URL in ','"),
        (["--contended", "wait"], "Invalid value for '--contended': 'wait' is not one of 'retry', 'skip'"),
    ],
)
def test_demo_rejects_bad_options_by_name(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "celery_redlock", "demo", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert message in result.stderr
