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
from celery_redlock.demo.run import burst, headline, plan, story

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


WAYS = (
    "· charged the invoice",
    "· deduplicated at enqueue",
    "· skipped: invoice locked",
    "· found it already charged",
)


@pytest.mark.timeout(150)
def test_demo_charges_each_invoice_once_through_a_duplicate_burst_and_a_master_kill() -> None:
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
    assert _row(out, "charge calls submitted") == "200"
    charged, deduplicated, skipped, already = (int(_row(out, way)) for way in WAYS)
    assert charged == 20  # each invoice once
    assert charged + deduplicated + skipped + already == 200  # every call ended one of the ways
    assert deduplicated > 0  # copies close together: handed the queued call's task id
    assert already > 0  # copies that came later: the body found the invoice charged
    assert _row(out, "· lost") == "0"
    assert _row(out, "invoices charged exactly once") == "20 of 20"
    assert _row(out, "overlaps found by the checker") == "0"
    assert int(_row(out, "bodies run under the lock")) == charged + already
    assert re.fullmatch(r"127\.0\.0\.1:\d+", _row(out, "master killed mid-burst"))
    assert re.fullmatch(r"\d+\.\d ms", _row(out, "lock acquire latency p99"))
    assert "200 charge calls, 20 of 20 invoices charged exactly once, 0 calls lost, 0 overlaps" in out
    assert re.search(r"^what the \d+ calls of invoice \d+ saw:$", out, re.M)
    assert re.search(r"^  1 call charged it \(task [0-9a-f]{8}\)$", out, re.M)
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


def _sent(writer: LedgerWriter, task_id: str, invoice: int, existing: str | None = None) -> None:
    writer.write("sent", task_id=task_id, invoice=invoice, via="app", existing=existing)


def test_the_summary_counts_each_event_and_names_the_overlapping_runs(tmp_path: Path) -> None:
    writer = LedgerWriter(tmp_path)
    runs = [
        ("a", "invoice:1", 0.0, 1.0, "charged"),
        ("b", "invoice:1", 1.0, 2.0, "already"),  # back to back: fine
        ("c", "invoice:1", 1.5, 1.7, "already"),  # inside b: overlap
        ("d", "invoice:2", 0.5, 1.5, "charged"),
    ]  # other resource
    for task_id, resource, start, end, outcome in runs:
        _sent(writer, task_id, int(resource.split(":")[1]))
        writer.write(
            "run",
            task_id=task_id,
            resource=resource,
            start=start,
            end=end,
            acquire=0.001,
            outcome=outcome,
            charged_by="a" if resource == "invoice:1" else "d",
        )
        writer.write("done", task_id=task_id, state="SUCCESS")
    _sent(writer, "e", 2)
    writer.write("retry", task_id="e")
    writer.write("done", task_id="e", state="RETRY")
    writer.write("done", task_id="e", state="SUCCESS", holder="d", reason="held by another run")
    _sent(writer, "f", 1, existing="a")  # deduplicated at enqueue
    reader = LedgerReader(tmp_path)
    reader.poll()
    summary = summarize(reader, submitted=6)
    assert [(a.task_id, b.task_id) for a, b in summary.overlaps] == [("b", "c")]
    assert (summary.finished, summary.ran, summary.waited, summary.skipped) == (6, 4, 1, 1)
    assert summary.ended == {
        "a": "charged",
        "b": "already",
        "c": "already",
        "d": "charged",
        "e": "skipped",
        "f": "deduplicated",
    }
    assert (summary.charges, summary.charged_once, summary.lost) == ({1: 1, 2: 1}, 2, 0)
    assert not summary.ok  # the overlap
    assert story(summary, reader) == [  # the invoice whose calls ended the most ways
        "what the 4 calls of invoice 1 saw:",
        "  1 call charged it (task a)",
        "  1 call deduplicated at enqueue: handed task a, queued or running",
        "  2 calls found it already charged by task a",
    ]


def test_the_verdict_fails_on_a_double_charge_or_a_call_that_ended_no_accounted_way(tmp_path: Path) -> None:
    writer = LedgerWriter(tmp_path)
    for task_id, start in (("a", 0.0), ("b", 1.0)):  # one after the other, both charged invoice 1
        _sent(writer, task_id, 1)
        writer.write("run", task_id=task_id, resource="invoice:1", start=start, end=start + 0.5, acquire=0.0)
        writer.write("done", task_id=task_id, state="SUCCESS")
    _sent(writer, "c", 2, existing="a")  # handed a call of another invoice
    _sent(writer, "d", 2)
    writer.write("done", task_id="d", state="SUCCESS", holder="a", reason="held by another run")  # ditto
    _sent(writer, "e", 2)
    writer.write("done", task_id="e", state="FAILURE")
    _sent(writer, "f", 2)  # never ended
    reader = LedgerReader(tmp_path)
    reader.poll()
    summary = summarize(reader, submitted=7)  # and one call never even recorded as sent
    assert summary.overlaps == []
    assert summary.charges == {1: 2, 2: 0}
    assert summary.charged_once == 0
    assert [summary.ended[t] for t in "cdef"] == ["unexplained", "unexplained", "failed", "unfinished"]
    assert summary.lost == 5
    assert not summary.ok
    assert (
        headline(summary) == "7 charge calls, 0 of 2 invoices charged exactly once, 5 calls lost, 0 overlaps"
    )


def test_burst_holds_every_invoice_and_clusters_duplicates() -> None:
    import itertools
    import random

    ids = burst(300, 30, random.Random(1))
    assert sorted(ids) == sorted(i % 30 + 1 for i in range(300))
    adjacent = sum(1 for a, b in itertools.pairwise(ids) if a == b)
    assert adjacent > 50  # copies of one call arrive close together, as duplicates do


def test_plan_sends_a_fraction_of_the_clusters_by_name() -> None:
    import random

    clusters = plan(300, 30, random.Random(1), by_name=0.25)
    assert sum(c.copies for c in clusters) == 300
    by_name = sum(1 for c in clusters if c.via == "name")
    assert 0.1 * len(clusters) < by_name < 0.4 * len(clusters)
    assert all(c.via == "app" for c in plan(300, 30, random.Random(1)))


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
                "--contended",
                "retry",
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
    assert _row(out, "· charged the invoice") == "8"
    assert _row(out, "· skipped: invoice locked") == "0"  # retry: a locked call waits its turn
    assert _row(out, "invoices charged exactly once") == "8 of 8"
    assert _row(out, "· lost") == "0"
    _assert_nothing_left(out, expected=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "5", "--invoices", "10"], "--tasks (5) must be at least --invoices (10)"),
        (["--workers", "0"], "Invalid value for '--workers': 0 is not in the range x>=1"),
        (["--masters", ","], "Invalid value for '--masters': no master URL in ','"),
        (["--contended", "wait"], "Invalid value for '--contended': 'wait' is not one of 'skip', 'retry'"),
        (["--by-name", "1.5"], "Invalid value for '--by-name': 1.5 is not in the range 0<=x<=1"),
        (["--spread", "0"], "Invalid value for '--spread': 0.0 is not in the range x>0"),
    ],
)
def test_demo_rejects_bad_options_by_name(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "celery_redlock", "demo", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert message in result.stderr
