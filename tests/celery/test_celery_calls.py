"""How a locked task is reached: direct calls (the plain function, no lock), eager ``apply()``
(locked, in this process), and messages from a publisher that does not use celery_redlock
(``lock_slot`` computed at the worker)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from conftest import records

from celery_redlock import NotLocked, Redlock, RedlockError, RedlockTask, is_skipped
from celery_redlock.celery.settings import close_app_redlock
from celery_redlock.celery.slots import slot_name
from celery_redlock.testing import CeleryWorker

Pool = tuple[str, str, list[CeleryWorker]]


@pytest.fixture
def calls_app(redlock_master_urls: list[str]) -> Iterator[Celery]:
    app = Celery("calls", set_as_current=False)
    app.conf.redlock_masters = redlock_master_urls
    yield app
    close_app_redlock(app)


def define_charge(app: Celery, seen: list[Any], urls: list[str]) -> Any:
    @app.task(
        bind=True,
        base=RedlockTask,
        lock_key="calls:<invoice_id>",
        name="calls.charge",
        lazy=False,
        shared=False,  # each test's app has its own: no other app of the session may inherit it
    )
    def charge(self: RedlockTask, invoice_id: int, check: bool = True) -> str:
        # Could another client take the resource while this body runs? Not when it is locked.
        with Redlock(urls) as other:
            contender = other.lock(f"calls:{invoice_id}", ttl=5)
            free = contender.acquire(blocking=False)
            if free:
                contender.release()
        seen.append(free)
        if check:
            self.redlock.ensure()
            seen.append(self.redlock.owned())
        return f"charged {invoice_id}"

    return charge


@pytest.mark.timeout(30)
def test_a_direct_call_is_the_plain_function_and_self_redlock_says_so(
    calls_app: Celery, redlock_master_urls: list[str]
) -> None:
    seen: list[Any] = []
    charge = define_charge(calls_app, seen, redlock_master_urls)
    # The body runs in the caller, unlocked: Celery's convention for calling a task object.
    assert charge(1, check=False) == "charged 1"
    assert seen == [True]
    # A body that relies on the lock learns at once that there is none, and why.
    with pytest.raises(NotLocked, match=r"called directly.*no lock.*delay\(\).*apply\(\)") as caught:
        charge(2)
    assert "calls.charge" in str(caught.value)
    assert isinstance(caught.value, RedlockError)  # one base class for every error of ours
    # Outside any run at all, too.
    with pytest.raises(NotLocked, match="no lock"):
        _ = charge.redlock


@pytest.mark.timeout(30)
def test_apply_runs_the_body_locked_in_this_process(
    calls_app: Celery, redlock_master_urls: list[str]
) -> None:
    seen: list[Any] = []
    charge = define_charge(calls_app, seen, redlock_master_urls)
    result = charge.apply((3,))
    assert result.get(timeout=5) == "charged 3"
    assert seen == [False, True]  # the resource was taken while the body ran, and owned
    with Redlock(redlock_master_urls) as check:
        lock = check.lock("calls:3", ttl=5)
        # Released, and answered by the masters, before apply() stored the result.
        assert lock.acquire(blocking=False), f"apply() left its lock held: {lock.last_votes}"
        lock.release()


# A publisher that has never heard of celery_redlock: plain Celery, in a process of its own,
# so no before_task_publish hook of ours stamps the redlock_published header.
FOREIGN_PUBLISHER = """
import json, sys
from celery import Celery
app = Celery("foreign", broker=sys.argv[1])
eta = float(sys.argv[5]) if sys.argv[5] else None
ids = []
for _ in range(int(sys.argv[4])):
    options = {"queue": sys.argv[3]}
    if eta is not None:
        import datetime as dt
        options["eta"] = dt.datetime.fromtimestamp(eta, tz=dt.timezone.utc)
    ids.append(app.send_task("lockapp.per_slot", args=[sys.argv[2], sys.argv[2]], **options).id)
print(json.dumps({"ids": ids, "ours": [m for m in sys.modules if m.startswith("celery_redlock")]}))
"""


def publish_foreign(
    broker_url: str, key: str, queue: str, copies: int, eta: float | None = None
) -> list[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            FOREIGN_PUBLISHER,
            broker_url,
            key,
            queue,
            str(copies),
            "" if eta is None else repr(eta),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    sent = json.loads(done.stdout)
    assert sent["ours"] == [], "the publisher was meant not to load celery_redlock"
    return list(sent["ids"])


def wait_for_states(lockapp: Any, ids: list[str], timeout: float) -> list[Any]:
    results = [lockapp.app.AsyncResult(i) for i in ids]
    deadline = time.monotonic() + timeout
    while not all(r.state in ("SUCCESS", "IGNORED", "FAILURE") for r in results):
        assert time.monotonic() < deadline, [r.state for r in results]
        time.sleep(0.05)
    return results


@pytest.mark.timeout(60)
def test_lock_slot_from_a_publisher_without_our_hooks(
    lockapp: Any, broker: Any, pool: Pool, tag: str
) -> None:
    """No redlock_published header: the worker takes the slot from the message's eta when it has
    one (every copy of one message agrees), else from its own clock when the run starts."""
    _, queue, workers = pool
    before = time.time()
    (plain,) = publish_foreign(broker.url, tag, queue, 1)
    (result,) = wait_for_states(lockapp, [plain], 30)
    after = time.time()
    assert result.state == "SUCCESS", result.result
    name = result.result
    assert name.startswith(f"slot:{tag}@"), name
    slot = dt.datetime.fromisoformat(name.split("@", 1)[1])
    assert slot.timestamp() % 60 == 0
    # The last slot begun by the time the run placed it (see celery_redlock.celery.slots).
    assert before - 60 < slot.timestamp() <= after, (before, name, after)
    assert [r["lock"] for r in records(lockapp, tag)] == [name]
    deadline = time.monotonic() + 5  # said once per task and process, at INFO
    while not any("without the redlock_published header" in w.log_text() for w in workers):
        assert time.monotonic() < deadline, "the worker did not log how it placed the message"
        time.sleep(0.05)

    # Two copies for one eta: one slot, so the second is skipped (on_expiry + skip).
    eta = time.time() + 1.0
    copies = publish_foreign(broker.url, f"{tag}-eta", queue, 2, eta=eta)
    states = wait_for_states(lockapp, copies, 30)
    assert [r.state for r in states] == ["SUCCESS", "SUCCESS"], [(r.state, r.result) for r in states]
    expected = f"slot:{tag}-eta@{slot_name(60, eta)}"
    ran = [r.result for r in states if not is_skipped(r.result)]
    skipped = [r.result for r in states if is_skipped(r.result)]
    assert ran == [expected], states
    assert len(skipped) == 1 and skipped[0]["key"] == expected
