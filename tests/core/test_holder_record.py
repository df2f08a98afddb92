"""The holder record: one writer (``HolderRecord.to_text``), one parser (``parse``), typed fields.

Properties: whatever a record holds, ``parse(record.to_text()) == record``, and the per-run form
``to_text(task=..., since=...)`` reads back as the record with those two fields set; a record
written before the queued flag, the heartbeat or the publish id existed still parses; text that
is not a record parses to None; and whether a record is a queued marker is its flag, never a
word found in it (a task *named* "...queued..." is a run).
"""

from __future__ import annotations

import dataclasses
import json
import math

from hypothesis import given
from hypothesis import strategies as st

from celery_redlock.lock.holder import HolderRecord, describe_holder, parse

texts = st.text(max_size=40)
numbers = st.floats(min_value=0, max_value=1e10, allow_nan=False, allow_infinity=False)
records = st.builds(
    HolderRecord,
    task=st.none() | texts,
    name=st.none() | texts,
    host=st.none() | texts,
    pid=st.none() | st.integers(min_value=0, max_value=2**31),
    since=st.none() | numbers.map(lambda s: round(s, 3)),
    ttl=st.none() | numbers,
    heartbeat=st.none() | numbers,
    queued=st.booleans(),
    published=st.none() | st.booleans(),  # what a record of no marker says is normalised away
    publish=st.none() | texts,
)


@given(records)
def test_what_to_text_writes_parse_reads_back(record: HolderRecord) -> None:
    text = record.to_text()
    assert "\n" not in text and "\r" not in text  # a holder is one line
    assert parse(text) == record


@given(records, texts, numbers, st.none() | texts)
def test_the_per_run_fields_are_filled_in_by_the_one_writer(
    record: HolderRecord, task: str, since: float, publish: str | None
) -> None:
    text = record.to_text(task=task, since=since, publish=publish)
    expected = dataclasses.replace(record, task=task, since=float(f"{since:.3f}"))
    if publish is not None:
        expected = dataclasses.replace(expected, publish=publish)
    assert parse(text) == expected


def test_a_record_written_before_the_new_fields_parses() -> None:
    old_run = '{"task":"t-1","name":"charge","host":"w3","pid":4411,"since":1700000000.125,"ttl":30}'
    assert parse(old_run) == HolderRecord(
        task="t-1", name="charge", host="w3", pid=4411, since=1700000000.125, ttl=30.0
    )
    old_marker = (
        '{"task":"t-2","name":"charge","host":"w3","pid":4411,"since":1700000000.5,"ttl":3600,"queued":true}'
    )
    marker = parse(old_marker)
    assert marker is not None and marker.queued and marker.task == "t-2" and marker.heartbeat is None


def test_queued_is_the_flag_not_a_word_in_the_record() -> None:
    run = HolderRecord(task="t-1", name="app.requeued_report", host="w", pid=1, since=1.0, ttl=5.0)
    assert "queued" in run.to_text()
    parsed = parse(run.to_text())
    assert parsed is not None and not parsed.queued
    assert parse('{"task":"queued","name":"queued","queued":false}') == HolderRecord(
        task="queued", name="queued"
    )
    marker = parse(dataclasses.replace(run, queued=True).to_text())
    assert marker is not None and marker.queued


def test_text_that_is_not_a_record_parses_to_none_and_wrong_types_are_dropped() -> None:
    for text in ("", "nightly export", "{", "[1, 2]", '"task"', "{not json}", "null"):
        assert parse(text) is None
    odd = parse('{"task": 7, "name": ["x"], "pid": "12", "since": true, "ttl": "5", "queued": "yes"}')
    assert odd == HolderRecord()
    assert parse('{"pid": 12.0, "ttl": 5, "heartbeat": 1.5, "publish": "p-1"}') == HolderRecord(
        pid=None, ttl=5.0, heartbeat=1.5, publish="p-1"
    )


def test_describe_says_queued_and_the_task_id() -> None:
    at = 1_700_000_010.0
    marker = HolderRecord(
        task="8c1f", name="charge", host="w3", pid=4411, since=at - 12.4, ttl=60.0, queued=True
    )
    said = marker.describe(at)
    assert said.startswith("queued: task charge 8c1f") and "12.4 s" in said
    run = dataclasses.replace(marker, queued=False)
    assert run.describe(at) == "task charge 8c1f on w3 pid 4411 for 12.4 s"
    assert describe_holder("nightly export") == "'nightly export'"
    assert describe_holder("") == "an unnamed holder"
    assert describe_holder(marker.to_text()).startswith("queued: task charge 8c1f")


def test_the_text_is_json() -> None:
    record = HolderRecord(task='a"b\\c\u00e9\u2028', name="n", host="h", pid=1, since=2.5, ttl=math.pi)
    assert json.loads(record.to_text())["task"] == 'a"b\\c\u00e9\u2028'
