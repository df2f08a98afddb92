"""The catch-up rule on its own (celery_redlock/celery/catchup.py): what a standby keeps of the
ticks it let pass, what a leader claims to have sent, and what a new leader sends.

Times are plain seconds; ``test_failover_tick.py`` runs the rule in real beats.
"""

from __future__ import annotations

import json

from celery_redlock.celery.catchup import RECORD_FIELD, CatchUp, sent_before

MINUTE = 60.0


def record(claim: object) -> bytes:
    return json.dumps({"hostname": "h", "pid": 1, RECORD_FIELD: claim}).encode()


def test_a_tick_due_after_the_leaders_last_claim_is_sent_once_for_its_latest_due_time() -> None:
    standby = CatchUp()
    standby.skip("report", 10 * MINUTE)
    standby.read(10 * MINUTE + 0.5)  # the leader swept past it: sent
    assert not standby.unsettled
    # The leader dies; the standby follows two more ticks before its lock expires.
    standby.skip("report", 11 * MINUTE)
    standby.skip("report", 12 * MINUTE)
    standby.read(10 * MINUTE + 20)  # its last record, written before it died
    assert standby.unsettled
    assert standby.take() == {"report": 12 * MINUTE}  # once, the latest
    assert standby.take() == {} and not standby.unsettled


def test_a_standby_carries_on_without_sending_what_a_leader_sent() -> None:
    standby = CatchUp()
    for minute in range(1, 6):
        standby.skip("report", minute * MINUTE)
        standby.skip("cleanup", minute * MINUTE + 30)
        standby.read(minute * MINUTE + 31)
    assert not standby.unsettled and standby.take() == {}
    # A due time already covered when it is let pass is not kept at all.
    standby.skip("report", 5 * MINUTE)
    assert not standby.unsettled


def test_claims_only_move_forward() -> None:
    standby = CatchUp()
    standby.skip("report", 100.0)
    standby.read(150.0)
    standby.read(None)  # a new leader before its first sweep says nothing
    standby.read(120.0)  # an older copy, or a leader whose clock is behind
    standby.skip("report", 140.0)
    assert standby.take() == {}


def test_a_standby_that_never_read_a_claim_sends_every_entry_it_let_pass() -> None:
    standby = CatchUp()
    standby.skip("report", 100.0)
    standby.skip("cleanup", 90.0)
    assert standby.take() == {"report": 100.0, "cleanup": 90.0}


def test_a_leader_claims_its_sweeps_never_past_now_nor_a_tick_it_let_pass() -> None:
    leader = CatchUp()
    leader.start_term()
    assert leader.claim(now=50.0) is None  # nothing swept yet this term
    leader.swept(60.0)  # nothing falls due before 60
    assert leader.claim(now=50.0) == 50.0
    assert leader.claim(now=70.0) == 60.0
    leader.swept(55.0)  # an earlier sweep reported late changes nothing
    assert leader.claim(now=70.0) == 60.0
    leader.skip("report", 58.0)  # too little validity left to send it
    assert leader.claim(now=70.0) == 58.0
    assert leader.take() == {"report": 58.0}  # its next tick sends it
    assert leader.claim(now=70.0) == 60.0
    leader.start_term()  # stepped down and took the lead again
    assert leader.claim(now=70.0) is None


def test_sent_before_takes_the_latest_claim_any_master_holds() -> None:
    copies = [record(100.0), None, record(120.5), b"not json", record(None)]
    assert sent_before(copies) == 120.5
    assert sent_before([record(True), record("soon"), record(float("nan")), b"[1, 2]"]) is None
    assert sent_before([json.dumps({"pid": 1}).encode(), None]) is None
    assert sent_before([]) is None
