"""One implementation, two front ends: ``celery -A cliapp redlock ...`` (the masters from the
app's settings) and ``celery-redlock ... --masters`` answer the same, in the same words, with
the same exit statuses; and a health check says how long it waited for a master that stopped
answering."""

from __future__ import annotations

import json
import uuid

import pytest

from celery_redlock import Redlock
from celery_redlock.lock import admin
from celery_redlock.testing import ServerSet

from ..core.conftest import take
from .conftest import celery_redlock, standalone

# Fields that change from one read to the next.
VOLATILE = {"read_at", "ttl_left", "pttl", "age", "rtt", "clock_offset"}


def stable(data: object) -> object:
    if isinstance(data, dict):
        return {k: stable(v) for k, v in data.items() if k not in VOLATILE}
    if isinstance(data, list):
        return [stable(v) for v in data]
    return data


@pytest.mark.timeout(120)
def test_both_front_ends_give_the_same_answers_and_exit_statuses(urls: str, rl: Redlock) -> None:
    resource = f"cli:{uuid.uuid4().hex[:8]}"
    lock = rl.lock(resource, ttl=30, holder="nightly export")
    assert take(lock)
    try:
        for args in (["show", resource], ["show", "never-taken"], ["ls", f"{resource}*"], ["health"]):
            app = celery_redlock(urls, *args, "--json")
            alone = standalone(*args, "--json", "--masters", urls)
            assert app.returncode == alone.returncode, (args, app.stderr, alone.stderr)
            assert stable(json.loads(app.stdout)) == stable(json.loads(alone.stdout)), args
        refused = celery_redlock(urls, "release", resource, "--yes", "--watch", "0.5")
        assert refused.returncode == 1 and "refused: its holder is unknown" in refused.stderr
        assert lock.owned() and lock.extend()
        for run in (
            celery_redlock(urls, "leader", "--json"),
            standalone("leader", "--json", "--masters", urls),
        ):
            assert run.returncode == 1 and json.loads(run.stdout)["leader"] is None
        assert "Exit status: 0 ok" in celery_redlock(urls, "show", "--help").stdout
        usage = celery_redlock(urls, "ls", "--timeout", "0")
        assert usage.returncode == 2 and "Invalid value for '--timeout'" in usage.stderr
    finally:
        lock.release()


@pytest.mark.timeout(60)
def test_a_master_that_stops_answering_is_down_for_the_time_the_check_waited(masters: ServerSet) -> None:
    masters.ensure_running()
    with Redlock(masters.urls) as rl:
        assert admin.health(rl, timeout=0.4).status in ("ok", "degraded")  # links made
        masters[2].pause()
        try:
            report = admin.health(rl, timeout=0.4)
        finally:
            masters[2].resume()
    down = report.masters[2]
    assert not down.reachable and report.exit_code == 1
    assert [f.what for f in down.findings] == ["unreachable: no reply within 0.4 s"]
