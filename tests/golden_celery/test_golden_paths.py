"""The golden outcome matrix: how every Celery path of a locked task ends, frozen.

Each case runs a real task on a real ``celery worker`` (one per pool: solo, prefork with two
children, threads) over a real broker and three real lock masters, or in this process for the
eager paths, and reduces what happened to an outcome free of ids, times and hosts:

- ``state``: what the result backend says once every run of the case is over and no worker
  still has one of its messages (``PENDING`` where nothing is stored, as after ``Ignore``;
  ``null`` for a direct call, which has no result);
- ``result``: its kind: a value (the case's tag written ``<tag>``), the skip marker
  (``is_skipped``: its key, reason and whether a task held the lock), or an exception's class;
- ``body_runs`` and ``body_held_lock``: how many times the body ran, and whether each run held
  its lock (``self.redlock.owned()``);
- ``lock_after``: who holds the lock key on a majority of the masters, read directly right after
  the result is visible (``free``; ``contender``: the test's own lock; ``task``: a run of the
  case; ``other``; ``split:...`` when no majority agrees);
- ``lock_signals``: the lock signals in the order they were sent (a run of ``contended:retry``
  counts once: how many lock retries a release lets pass depends on timing);
- ``postrun``: the states ``task_postrun`` reported, as a set (``<task>:<state>``);
- ``extra``: what a path checks beyond these (say, the depth a reentrant body saw).

The golden file ``data/paths.json`` holds the whole matrix. A normal run compares each
(pool, path) with it and never writes it; ``CELERY_REDLOCK_GOLDEN_UPDATE=1`` records the outcomes
and rewrites it instead, once the module ends.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import pytest
import redis
from celery import chain

from celery_redlock import Lock, Redlock, is_skipped
from celery_redlock.testing import RedisServer, ServerSet
from tests import waiting

from .conftest import WORKER_POOLS, records_url

GOLDEN = Path(__file__).resolve().parent / "data" / "paths.json"
UPDATE = os.environ.get("CELERY_REDLOCK_GOLDEN_UPDATE") == "1"
EAGER = "eager"
KEY_PREFIX = "redlock:"
TASK_WIDE_KEY = "%task:golden.task_wide"
TERMINAL = ("SUCCESS", "FAILURE", "IGNORED", "REJECTED")
UNACKED = "unacked"  # kombu's Redis transport: messages delivered and not yet acknowledged
DEADLINE = 20.0  # seconds any one wait of a case may take
CONTENDER_TTL = 20.0


# -- one case -----------------------------------------------------------------------------------------
@dataclass
class Run:
    """What a path started: the result to wait for, and how the case ends."""

    result: Any  # AsyncResult, EagerResult, or None for a direct call
    value: Any = None  # a direct call's return value
    key: str = ""  # the lock name, when not golden:<tag>
    contender: Lock | None = None  # released once the lock was read after the result
    ended_by_postrun: bool = False  # nothing is stored (Ignore, Reject): the postrun says it ended
    terminal_runs: int = 1  # runs of the final task id that end terminally (retry(throw=False): 2)
    extra: dict[str, Any] = field(default_factory=dict)


class Case:
    """One (pool, path): its tag, its queue, and what it reads."""

    def __init__(
        self,
        pool: str,
        queue: str | None,
        app: ModuleType,
        records: redis.Redis,
        masters: list[redis.Redis],
        broker: redis.Redis,
        contender: Redlock,
    ) -> None:
        self.pool = pool
        self.queue = queue
        self.app = app
        self.records = records
        self.masters = masters
        self.broker = broker
        self.redlock = contender
        self.tag = f"{pool}-{os.urandom(5).hex()}"
        self.key = f"golden:{self.tag}"
        self.threads: list[threading.Thread] = []
        self.thread_errors: list[str] = []
        self.contender_tokens: set[str] = set()
        self.records.delete(self.app.signal_list(TASK_WIDE_KEY))  # shared by every task_wide case

    @property
    def eager(self) -> bool:
        return self.queue is None

    # -- starting things ------------------------------------------------------------------------
    def send(self, task: Any, *args: Any) -> Any:
        """Run ``task`` as the pool says: published to the pool's worker, or ``apply()`` here."""
        if self.queue is None:
            return task.apply(args)
        return task.apply_async(args, queue=self.queue)

    def sig(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        return task.si(*args, **kwargs).set(queue=self.queue)

    def hold(self, name: str | None = None) -> Lock:
        """Take the lock a run of this case contends for, as a plain client of the same masters."""
        lock = self.redlock.lock(name or self.key, ttl=CONTENDER_TTL)
        assert lock.acquire(timeout=5), lock.last_error
        assert lock.token is not None
        self.contender_tokens.add(lock.token.partition("|")[0])
        return lock

    def release_when(self, lock: Lock, predicate: Callable[[], Any], what: str) -> None:
        """Release ``lock`` from a helper thread once ``predicate`` holds (an event the run
        causes), so an eager run blocking this thread can be released too."""

        def work() -> None:
            try:
                wait_until(predicate, what)
            except AssertionError as exc:
                self.thread_errors.append(str(exc))
            finally:
                lock.release()

        thread = threading.Thread(target=work, name=f"golden-release-{self.tag}", daemon=True)
        thread.start()
        self.threads.append(thread)

    # -- reading ---------------------------------------------------------------------------------
    def signals(self, key: str = "") -> list[str]:
        return [str(raw) for raw in self.records.lrange(self.app.signal_list(key or self.key), 0, -1)]

    def runs(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records.lrange(self.app.runs_list(self.tag), 0, -1)]

    def postruns(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.records.lrange(self.app.postrun_list(self.tag), 0, -1)]

    def waiters(self, name: str = "") -> int:
        """Clients subscribed to the lock key's channel on the masters: a run in ``wait`` mode."""
        channel = KEY_PREFIX + (name or self.key)
        return sum(int(count) for master in self.masters for _, count in master.pubsub_numsub(channel))

    def lock_after(self, name: str, task_ids: set[str]) -> str:
        """Who holds ``name`` on a majority of the masters, read directly."""
        labels = [self._label(master, KEY_PREFIX + name, task_ids) for master in self.masters]
        label, votes = Counter(labels).most_common(1)[0]
        return label if votes > len(self.masters) // 2 else "split:" + ",".join(sorted(labels))

    def _label(self, master: redis.Redis, key: str, task_ids: set[str]) -> str:
        kind = master.type(key)
        if kind == "hash":
            return "task"  # a reentrant holding: {token: depth}
        raw = master.get(key) if kind == "string" else None
        if raw is None:
            return "free"
        token, _, holder = str(raw).partition("|")
        if token in self.contender_tokens:
            return "contender"
        record = json.loads(holder) if holder.startswith("{") else {}
        return "task" if record.get("task") in task_ids else "other"

    def in_flight(self, ids: set[str]) -> bool:
        """Whether the broker still has a message of ``ids`` delivered and not yet acknowledged
        (kombu's Redis transport keeps those in ``unacked``): a worker is not done with it."""
        return any(i in str(raw) for raw in self.broker.hvals(UNACKED) for i in ids)

    def finish(self) -> None:
        for thread in self.threads:
            thread.join(DEADLINE)
        assert not self.thread_errors, self.thread_errors


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """The suite's one polling helper, with the matrix's deadline as the default."""
    return waiting.wait_until(predicate, timeout, what, every=0.01)


# -- the paths ----------------------------------------------------------------------------------------
def body_succeeds(c: Case) -> Run:
    return Run(c.send(c.app.succeeds, c.tag))


def body_raises(c: Case) -> Run:
    return Run(c.send(c.app.raises, c.tag))


def own_retry_then_succeeds(c: Case) -> Run:
    return Run(c.send(c.app.retries_once, c.tag))


def ignore(c: Case) -> Run:
    return Run(c.send(c.app.ignores, c.tag), ended_by_postrun=True)


def reject_no_requeue(c: Case) -> Run:
    return Run(c.send(c.app.rejects, c.tag), ended_by_postrun=True)


def contended_skip(c: Case) -> Run:
    held = c.hold()  # for the whole run
    return Run(c.send(c.app.skips, c.tag), contender=held)


def contended_fail(c: Case) -> Run:
    held = c.hold()
    return Run(c.send(c.app.fails, c.tag), contender=held)


def contended_retry_then_runs(c: Case) -> Run:
    """Held until the run has made its first lock retry, then released: a later retry gets in."""
    held = c.hold()
    c.release_when(held, lambda: "contended:retry" in c.signals(), "the first lock retry")
    return Run(c.send(c.app.retries, c.tag))


def contended_retry_exhausted(c: Case) -> Run:
    """Held for the whole run: its two lock retries run out."""
    held = c.hold()
    return Run(c.send(c.app.exhausts, c.tag), contender=held)


def contended_wait(c: Case) -> Run:
    """Held until the run waits on the key's channel, then released: the release wakes it."""
    held = c.hold()
    c.release_when(held, c.waiters, "the run to wait for the lock")
    return Run(c.send(c.app.waits, c.tag))


def task_wide_lock(c: Case) -> Run:
    return Run(c.send(c.app.task_wide, c.tag), key=TASK_WIDE_KEY)


def task_wide_contended_skip(c: Case) -> Run:
    held = c.hold(TASK_WIDE_KEY)
    return Run(c.send(c.app.task_wide, c.tag), key=TASK_WIDE_KEY, contender=held)


def chain_of_three_on_one_key(c: Case) -> Run:
    """Each link locks the key the previous one released; a link that found it held would be
    skipped."""
    links = [c.sig(c.app.link, c.tag, n) for n in (1, 2, 3)]
    return Run(chain(*links).apply_async())


def chain_after_a_skip(c: Case) -> Run:
    """A skipped link's marker goes on down the chain as the next link's argument."""
    held = c.hold()
    links = chain(c.sig(c.app.skips, c.tag), c.app.collect.s(tag=c.tag).set(queue=c.queue))
    return Run(links.apply_async(), contender=held)


def fallback_after_max_retries(c: Case) -> Run:
    return Run(c.send(c.app.fallback, c.tag))


def retry_without_throw(c: Case) -> Run:
    return Run(c.send(c.app.no_throw, c.tag), terminal_runs=2)


def release_on_expiry(c: Case) -> Run:
    return Run(c.send(c.app.expires, c.tag))


def reentrant_body(c: Case) -> Run:
    return Run(c.send(c.app.reentrant, c.tag))


def send_task_by_name(c: Case) -> Run:
    return Run(c.app.app.send_task("golden.succeeds", args=(c.tag,), queue=c.queue))


def enqueue_return_existing(c: Case) -> Run:
    """A second publish while the first runs gets the first's result; nothing is published."""
    flag = f"golden:flag:{c.tag}"
    first = c.app.enqueued.apply_async((c.tag, flag, DEADLINE), queue=c.queue)
    wait_until(c.runs, "the first run's body")
    second = c.app.enqueued.apply_async((c.tag, flag, DEADLINE), queue=c.queue)
    c.records.set(flag, 1)
    return Run(first, extra={"second_call_got_first_id": second.id == first.id})


def direct_call(c: Case) -> Run:
    """``task(...)``: the plain function, in this process, with no lock."""
    return Run(None, value=c.app.succeeds(c.tag))


PathFn = Callable[[Case], Run]
WORKER_PATHS: dict[str, PathFn] = {
    f.__name__: f
    for f in (
        body_succeeds,
        body_raises,
        own_retry_then_succeeds,
        ignore,
        reject_no_requeue,
        contended_skip,
        contended_fail,
        contended_retry_then_runs,
        contended_retry_exhausted,
        contended_wait,
        task_wide_lock,
        task_wide_contended_skip,
        chain_of_three_on_one_key,
        chain_after_a_skip,
        fallback_after_max_retries,
        retry_without_throw,
        release_on_expiry,
        reentrant_body,
        send_task_by_name,
        enqueue_return_existing,
    )
}
EAGER_PATHS: dict[str, PathFn] = {
    f.__name__: f
    for f in (
        body_succeeds,
        body_raises,
        contended_skip,
        contended_fail,
        contended_retry_then_runs,
        contended_retry_exhausted,
        contended_wait,
        task_wide_lock,
        reentrant_body,
        direct_call,
    )
}
MATRIX = [(pool, path) for pool in WORKER_POOLS for path in WORKER_PATHS] + [
    (EAGER, path) for path in EAGER_PATHS
]


# -- outcome ------------------------------------------------------------------------------------------
def chain_ids(result: Any) -> list[str]:
    """The task ids of a result and its parents (a chain's links), first link first."""
    ids: list[str] = []
    while result is not None:
        ids.insert(0, str(result.id))
        result = getattr(result, "parent", None)
    return ids


def normalised(value: Any, tag: str) -> Any:
    """``value`` as JSON, with the case's tag written ``<tag>``."""
    return json.loads(json.dumps(value, default=repr).replace(tag, "<tag>"))


def result_kind(value: Any, tag: str) -> dict[str, Any]:
    if is_skipped(value):
        return {
            "kind": "skipped",
            "key": normalised(value.get("key"), tag),
            "reason": value.get("reason"),
            "holder": None if value.get("holder") is None else "task",
        }
    if isinstance(value, BaseException):
        return {"kind": "exception", "class": type(value).__name__}
    return {"kind": "value", "value": normalised(value, tag)}


def collapsed(events: list[str]) -> list[str]:
    """``events`` with each run of ``contended:retry`` counted once."""
    kept: list[str] = []
    for event in events:
        if not (event == "contended:retry" and kept and kept[-1] == event):
            kept.append(event)
    return kept


def observe(c: Case, run: Run) -> dict[str, Any]:
    """Wait for ``run`` to end (deadlines, never bare sleeps) and reduce it to its outcome."""
    key = run.key or c.key
    ids = set(chain_ids(run.result)) if run.result is not None else set()
    final_id = None if run.result is None else str(run.result.id)
    try:
        if run.ended_by_postrun:  # nothing is stored: the tracer's postrun says the run ended
            wait_until(
                lambda: any(p["id"] == final_id and p["state"] in TERMINAL for p in c.postruns()),
                "the run's task_postrun",
            )
        elif run.result is not None:
            run.result.get(timeout=DEADLINE, propagate=False)
        lock_after = c.lock_after(key, ids)  # right after the result is visible
    finally:
        if run.contender is not None:
            run.contender.release()
        c.finish()
    state, value = None, run.value
    if run.result is not None:
        # Everything of the case has ended: each task id's terminal postrun is in, and no worker
        # still has one of its messages (the worker stores a Reject's FAILURE after the postrun).
        def settled() -> bool:
            ended = Counter(p["id"] for p in c.postruns() if p["state"] in TERMINAL)
            wanted = {i: 1 for i in ids}
            wanted[str(final_id)] = run.terminal_runs
            return all(ended[i] >= n for i, n in wanted.items()) and not c.in_flight(ids)

        wait_until(settled, "every run of the case to end")
        final = run.result if c.eager else c.app.app.AsyncResult(final_id)  # read afresh
        state, value = final.state, final.result
    runs = c.runs()
    return {
        "state": state,
        "result": {"kind": "none"} if state == "PENDING" else result_kind(value, c.tag),
        "body_runs": len(runs),
        "body_held_lock": [r["owned"] for r in runs],
        "lock_after": lock_after,
        "lock_signals": collapsed(c.signals(key)),
        "postrun": sorted({f"{p['task']}:{p['state']}" for p in c.postruns()}),
        "extra": normalised(run.extra, c.tag),
    }


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """One line per field that differs, golden first."""
    return [
        f"  {name}: golden {json.dumps(expected.get(name))} != now {json.dumps(actual.get(name))}"
        for name in sorted(set(expected) | set(actual))
        if expected.get(name) != actual.get(name)
    ]


def load_golden() -> dict[str, Any]:
    """``{"celery": the version it was recorded under, "matrix": {pool: {path: outcome}}}``."""
    if not GOLDEN.exists():
        return {"celery": None, "matrix": {}}
    loaded: dict[str, Any] = json.loads(GOLDEN.read_text())
    return loaded


def write_golden(matrix: dict[str, dict[str, Any]]) -> None:
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    document = {"celery": celery.__version__, "matrix": matrix}
    GOLDEN.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded() -> Iterator[dict[str, dict[str, Any]]]:
    """The outcomes of this run; in update mode, merged into the golden file at the end."""
    outcomes: dict[str, dict[str, Any]] = {}
    yield outcomes
    if UPDATE and outcomes:
        matrix: dict[str, dict[str, Any]] = load_golden()["matrix"]
        for pool, paths in outcomes.items():
            matrix.setdefault(pool, {}).update(paths)
        # Entries no longer in the matrix (a path renamed or dropped) go.
        write_golden(
            {
                pool: {path: o for path, o in paths.items() if (pool, path) in MATRIX}
                for pool, paths in matrix.items()
            }
        )


@pytest.fixture(scope="module")
def master_clients(golden_masters: ServerSet) -> Iterator[list[redis.Redis]]:
    clients = [server.client(decode_responses=True) for server in golden_masters]
    yield clients
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def broker_client(golden_broker: RedisServer) -> Iterator[redis.Redis]:
    client = golden_broker.client(decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def records_client(golden_broker: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(records_url(golden_broker), socket_timeout=5, decode_responses=True)
    yield client
    client.close()


# -- tests --------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("pool", "path"), MATRIX, ids=[f"{pool}-{path}" for pool, path in MATRIX])
def test_outcome_matches_the_golden_file(
    request: pytest.FixtureRequest,
    pool: str,
    path: str,
    golden_app: ModuleType,
    golden_contender: Redlock,
    master_clients: list[redis.Redis],
    records_client: redis.Redis,
    broker_client: redis.Redis,
    recorded: dict[str, dict[str, Any]],
) -> None:
    queue = None
    if pool != EAGER:
        queue = request.getfixturevalue("golden_workers")[pool]
    case = Case(pool, queue, golden_app, records_client, master_clients, broker_client, golden_contender)
    paths = EAGER_PATHS if pool == EAGER else WORKER_PATHS
    outcome = observe(case, paths[path](case))
    recorded.setdefault(pool, {})[path] = outcome
    if UPDATE:
        return
    golden = load_golden()
    expected = golden["matrix"].get(pool, {}).get(path)
    assert expected is not None, (
        f"{GOLDEN.name} has no entry for ({pool}, {path}); record it with "
        f"CELERY_REDLOCK_GOLDEN_UPDATE=1. Outcome now:\n{json.dumps(outcome, indent=2, sort_keys=True)}"
    )
    if outcome != expected:
        note = ""
        if golden["celery"] != celery.__version__:
            note = (
                f"\n(recorded under Celery {golden['celery']}, running {celery.__version__}: a "
                "difference may be Celery's own; re-record only once it is understood)"
            )
        pytest.fail(
            f"({pool}, {path}) differs from {GOLDEN.name}:\n"
            + "\n".join(differences(expected, outcome))
            + note,
            pytrace=False,
        )


@pytest.mark.timeout(10)
def test_the_golden_file_holds_exactly_the_matrix() -> None:
    if UPDATE:
        pytest.skip("the golden file is being rewritten")
    golden = load_golden()
    have = {(pool, path) for pool, paths in golden["matrix"].items() for path in paths}
    want = set(MATRIX)
    assert have == want, f"missing: {sorted(want - have)}; stale: {sorted(have - want)}"
    assert GOLDEN.read_text() == json.dumps(golden, indent=2, sort_keys=True) + "\n", "not sorted JSON"


@pytest.mark.timeout(10)
def test_a_difference_names_each_field_that_changed() -> None:
    golden = {"state": "SUCCESS", "body_runs": 1, "lock_after": "free"}
    now = {"state": "SUCCESS", "body_runs": 2, "lock_after": "task"}
    assert differences(golden, now) == [
        "  body_runs: golden 1 != now 2",
        '  lock_after: golden "free" != now "task"',
    ]
    assert differences(golden, dict(golden)) == []
