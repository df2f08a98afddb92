"""The resource side of fencing (celery_redlock.fenced), on real SQLite, PostgreSQL and Redis.

Invariants attacked here:
- a fenced write (claim or update) is accepted with a fence equal to or above the stored one,
  and refused with ``StaleFence`` carrying the stored fence when below it, with nothing written;
  a missing row is ``LookupError``, never a silent success or a ``StaleFence``;
- two connections racing: a stale claim that waits for a newer one (PostgreSQL's row lock under
  READ COMMITTED, SQLite's busy timeout) is refused once it runs, and a stale claim that got in
  first is read by the newer holder, so no update is lost either way; under REPEATABLE READ the
  loser gets the driver's serialization failure instead, and its retry the ``StaleFence``;
- nothing but a plain identifier reaches the SQL text, and only positive ints are fences;
- every paramstyle the helper claims produces SQL its driver runs;
- the Redis key: the fence lives at ``key + "~fence"``, a stale read or write changes nothing,
  ``px`` is honoured (and 0 is refused, not taken as "no TTL");
- end to end: fences from a real fenced lock on five masters make a holder that stalls past its
  TTL harmless to a Redis key and a SQLite row that a later holder has written.

PostgreSQL is the server at 127.0.0.1:5432 (trust auth, user postgres); each run creates and
drops a database of its own. Unreachable, its tests skip with the reason, except under CI=true,
where they fail.
"""

from __future__ import annotations

import os
import pickle
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_redlock import ConfigError, Redlock, StaleFence
from celery_redlock.fenced import FencedKey, FencedRows
from celery_redlock.lock import scripts
from celery_redlock.testing import RedisServer, ServerSet
from tests.waiting import wait_until

from .conftest import take

pytestmark = pytest.mark.timeout(60)

PG_DSN = "host=127.0.0.1 port=5432 user=postgres connect_timeout=3"


class Outcome:
    """What a function run in a thread returned or raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.value = fn()
        except BaseException as error:
            self.error = error

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 15.0) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the thread did not finish in time"
        if self.error is not None:
            raise self.error
        return self.value


# -- the databases ----------------------------------------------------------------------------------


def _postgres_unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (PostgreSQL is required when CI=true)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def pg_database() -> Iterator[str]:
    """A database of this run's own on the local PostgreSQL, dropped afterwards: its conninfo."""
    try:
        import psycopg
    except ImportError as error:
        _postgres_unavailable(f"psycopg is not installed: {error}")
    try:
        admin = psycopg.connect(PG_DSN + " dbname=postgres", autocommit=True)
    except psycopg.OperationalError as error:
        _postgres_unavailable(f"PostgreSQL at 127.0.0.1:5432 is unreachable: {error}")
    name = f"fenced_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        admin.execute(f"CREATE DATABASE {name}")
        yield f"{PG_DSN} dbname={name}"
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@dataclass
class Db:
    """One database under test: how to connect, and its driver's placeholder for our own SQL."""

    kind: str
    connect: Callable[..., Any]
    placeholder: str
    connections: list[Any]

    def sql(self, text: str) -> str:
        return text.replace("?", self.placeholder)

    def open(self, **options: Any) -> Any:
        conn = self.connect(**options)
        self.connections.append(conn)
        return conn

    def balance_and_fence(self, key: int = 1) -> tuple[int, int]:
        """Read by a fresh connection: only what was committed."""
        conn = self.open()
        try:
            cur = conn.cursor()
            cur.execute(self.sql("SELECT balance, fence FROM accounts WHERE id = ?"), (key,))
            balance, fence = cur.fetchone()
            return int(balance), int(fence)
        finally:
            conn.rollback()


SCHEMA = (
    "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL DEFAULT 0, "
    "key TEXT, fence BIGINT NOT NULL DEFAULT 0)"
)


def _fresh(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    """A fresh ``accounts`` table holding row 1 (balance 0, fence 0)."""
    if kind == "sqlite":
        path = tmp_path / "ledger.sqlite3"

        def connect_sqlite(timeout: float = 10.0, **options: Any) -> Any:
            return sqlite3.connect(path, timeout=timeout, check_same_thread=False, **options)

        found = Db("sqlite", connect_sqlite, "?", [])
    else:
        import psycopg

        dsn = request.getfixturevalue("pg_database")

        def connect_postgres(**options: Any) -> Any:
            # lock_timeout bounds every wait on a row lock, so no test can hang on one.
            options.setdefault("options", "-c lock_timeout=10000")
            return psycopg.connect(dsn, **options)

        found = Db("postgres", connect_postgres, "%s", [])
    setup = found.open()
    cur = setup.cursor()
    cur.execute("DROP TABLE IF EXISTS accounts")
    cur.execute(SCHEMA)
    cur.execute("INSERT INTO accounts (id) VALUES (1)")
    setup.commit()
    try:
        yield found
    finally:
        for conn in found.connections:
            conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    yield from _fresh(request.param, request, tmp_path)


@pytest.fixture
def pg(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    yield from _fresh("postgres", request, tmp_path)


ROWS = FencedRows("accounts", key="id", fence="fence")


# -- FencedRows: accept, refuse, missing -------------------------------------------------------------


def test_claim_and_update_accept_equal_and_higher_fences(db: Db) -> None:
    conn = db.open()
    cur = conn.cursor()
    ROWS.claim(cur, 1, 5)
    ROWS.claim(cur, 1, 5)  # equal: the same holder claims again
    ROWS.update(cur, 1, 5, balance=10)  # equal: the claimer writes
    ROWS.update(cur, 1, 5, balance=11)  # and writes again
    assert ROWS.current(cur, 1) == 5
    ROWS.update(cur, 1, 9, balance=20)  # higher, without a claim: the single-statement form
    ROWS.claim(cur, 1, 12)
    conn.commit()
    assert db.balance_and_fence() == (20, 12)


def test_a_lower_fence_is_refused_with_the_stored_fence_and_writes_nothing(db: Db) -> None:
    conn = db.open()
    cur = conn.cursor()
    ROWS.update(cur, 1, 7, balance=70)
    conn.commit()
    with pytest.raises(StaleFence) as claimed:
        ROWS.claim(cur, 1, 6)
    assert (claimed.value.resource, claimed.value.fence, claimed.value.current) == ("accounts[id=1]", 6, 7)
    with pytest.raises(StaleFence) as updated:
        ROWS.update(cur, 1, 1, balance=99)
    assert (updated.value.fence, updated.value.current) == (1, 7)
    assert "already seen 7" in str(updated.value)
    conn.commit()
    assert db.balance_and_fence() == (70, 7)
    # Plain-typed args: the error survives a pickling result backend whole.
    copy = pickle.loads(pickle.dumps(updated.value))
    assert (copy.resource, copy.fence, copy.current) == ("accounts[id=1]", 1, 7)


def test_a_missing_row_is_a_lookup_error(db: Db) -> None:
    conn = db.open()
    cur = conn.cursor()
    with pytest.raises(LookupError, match="no row with id = 404"):
        ROWS.claim(cur, 404, 5)
    with pytest.raises(LookupError):
        ROWS.update(cur, 404, 5, balance=1)
    assert ROWS.current(cur, 404) is None
    conn.commit()
    assert db.balance_and_fence() == (0, 0)


def test_columns_named_key_fence_or_cursor_can_be_set_but_not_the_fence_column(db: Db) -> None:
    conn = db.open()
    cur = conn.cursor()
    ROWS.update(cur, 1, 3, key="k-1")  # positional-only arguments: no clash with `key`
    cur.execute(db.sql("SELECT key, fence FROM accounts WHERE id = ?"), (1,))
    assert tuple(cur.fetchone()) == ("k-1", 3)
    with pytest.raises(ConfigError, match="fence column"):
        ROWS.update(cur, 1, 4, fence=2)
    other = FencedRows("accounts", key="id", fence="balance")
    with pytest.raises(ConfigError, match="fence column"):
        other.update(cur, 1, 4, balance=2)


def test_a_null_fence_column_is_reported_as_a_schema_error(db: Db) -> None:
    conn = db.open()
    cur = conn.cursor()
    cur.execute("CREATE TABLE loose (id INTEGER PRIMARY KEY, v INTEGER, fence BIGINT)")
    cur.execute("INSERT INTO loose (id) VALUES (1)")
    with pytest.raises(ConfigError, match="NOT NULL DEFAULT 0"):
        FencedRows("loose").claim(cur, 1, 5)


# -- FencedRows: two connections racing ------------------------------------------------------------


def _wait_until_blocked(db: Db, conn: Any, pending: Outcome) -> None:
    """Until ``pending``'s statement on ``conn`` waits for the other connection's lock."""
    if db.kind == "postgres":
        watcher = db.open(autocommit=True)
        query = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s"
        pid = conn.info.backend_pid
        wait_until(lambda: watcher.execute(query, (pid,)).fetchone() == ("Lock",), 10, "wait on the row lock")
    else:
        # SQLite has no view of its waiters: the claim is still in its busy handler.
        time.sleep(0.3)
    assert not pending.done(), pending.error


def test_a_stale_claim_waits_for_a_newer_one_then_is_refused(db: Db) -> None:
    newer, stale = db.open(), db.open()
    ROWS.claim(newer.cursor(), 1, 10)  # holds the row (PostgreSQL) or the write lock (SQLite)
    pending = Outcome(lambda: ROWS.claim(stale.cursor(), 1, 5))
    _wait_until_blocked(db, stale, pending)
    cur = newer.cursor()
    ROWS.update(cur, 1, 10, balance=100)
    newer.commit()
    # PostgreSQL re-checks the WHERE clause against the committed row: 0 rows, then StaleFence.
    with pytest.raises(StaleFence) as refused:
        pending.result()
    assert (refused.value.fence, refused.value.current) == (5, 10)
    stale.rollback()
    assert db.balance_and_fence() == (100, 10)


def test_a_stale_claim_that_got_in_first_is_read_by_the_newer_holder(db: Db) -> None:
    """The other order: the resource has not seen the newer fence yet, so the stale holder's
    read-modify-write goes through, whole, and the newer holder, waiting on it, reads its result:
    nothing is lost."""
    stale, newer = db.open(), db.open()
    scur = stale.cursor()
    ROWS.claim(scur, 1, 5)
    scur.execute(db.sql("SELECT balance FROM accounts WHERE id = ?"), (1,))
    (stale_balance,) = scur.fetchone()

    def newer_credit() -> int:
        cur = newer.cursor()
        ROWS.claim(cur, 1, 10)
        cur.execute(db.sql("SELECT balance FROM accounts WHERE id = ?"), (1,))
        (balance,) = cur.fetchone()
        ROWS.update(cur, 1, 10, balance=balance + 50)
        newer.commit()
        return int(balance)

    pending = Outcome(newer_credit)
    _wait_until_blocked(db, newer, pending)
    ROWS.update(scur, 1, 5, balance=stale_balance + 100)
    stale.commit()
    assert pending.result() == 100
    assert db.balance_and_fence() == (150, 10)


def test_a_claim_left_open_by_a_paused_holder_makes_the_next_holder_wait(db: Db) -> None:
    """Safe but not live: a holder paused inside the claim's transaction keeps the row lock
    (PostgreSQL) or the database's write lock (SQLite), so the next holder waits for it, up to
    its lock_timeout or busy timeout. Committing the claim on its own (as the fenced_ledger
    example does) keeps the protection and frees the row."""
    paused = db.open()
    ROWS.claim(paused.cursor(), 1, 5)  # ... and the process stops here, transaction open
    if db.kind == "postgres":
        import psycopg

        impatient = db.open(options="-c lock_timeout=300")
        error: type[BaseException] = psycopg.errors.LockNotAvailable
    else:
        impatient = db.open(timeout=0.3)
        error = sqlite3.OperationalError
    started = time.monotonic()
    with pytest.raises(error):
        ROWS.claim(impatient.cursor(), 1, 10)
    assert time.monotonic() - started >= 0.25
    impatient.rollback()
    paused.commit()  # the same claim, committed on its own: no lock held any more
    cur = impatient.cursor()
    ROWS.claim(cur, 1, 10)
    impatient.commit()
    with pytest.raises(StaleFence):  # and the paused holder's late write is still refused
        ROWS.update(paused.cursor(), 1, 5, balance=1)
    paused.rollback()
    assert db.balance_and_fence() == (0, 10)


def test_a_row_replaced_under_a_waiting_claim_is_reported_not_taken_for_a_refusal(pg: Db) -> None:
    """READ COMMITTED: a claim waiting on a row that another transaction deletes and inserts
    again (with fence 0) matches no row, yet the row's fence is below the claim's. Neither
    StaleFence nor success is true; the helper says so and asks for a retry, which succeeds."""
    replacer, claimer = pg.open(), pg.open()
    rcur = replacer.cursor()
    rcur.execute("DELETE FROM accounts WHERE id = 1")
    rcur.execute("INSERT INTO accounts (id, balance) VALUES (1, 7)")
    pending = Outcome(lambda: ROWS.claim(claimer.cursor(), 1, 5))
    _wait_until_blocked(pg, claimer, pending)
    replacer.commit()
    with pytest.raises(RuntimeError, match="retry the transaction"):
        pending.result()
    claimer.rollback()
    ROWS.claim(claimer.cursor(), 1, 5)
    claimer.commit()
    assert pg.balance_and_fence() == (7, 5)


def test_repeatable_read_a_waiting_stale_claim_gets_a_serialization_failure(pg: Db) -> None:
    """Under REPEATABLE READ the stale claimer does not get 0 rows: PostgreSQL refuses to update
    a row changed since its snapshot, and psycopg raises SerializationFailure ("could not
    serialize access due to concurrent update"). That is the driver's error, not StaleFence: the
    caller retries the transaction, and the retry gets StaleFence."""
    import psycopg

    newer = pg.open()
    stale = pg.open()
    stale.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    ROWS.claim(newer.cursor(), 1, 10)
    pending = Outcome(lambda: ROWS.claim(stale.cursor(), 1, 5))
    _wait_until_blocked(pg, stale, pending)
    newer.commit()
    with pytest.raises(psycopg.errors.SerializationFailure, match="concurrent update"):
        pending.result()
    stale.rollback()
    with pytest.raises(StaleFence) as refused:
        ROWS.claim(stale.cursor(), 1, 5)
    assert refused.value.current == 10
    stale.rollback()


def test_repeatable_read_a_claim_after_a_newer_commit_fails_even_when_it_is_the_newer(pg: Db) -> None:
    """A snapshot taken before another claim committed makes any later write of that row a
    serialization failure, whichever fence is higher: under REPEATABLE READ even the newer holder
    retries its transaction (and then succeeds)."""
    import psycopg

    late = pg.open()
    late.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    late.execute("SELECT 1 FROM accounts").fetchall()  # the snapshot
    other = pg.open()
    ROWS.claim(other.cursor(), 1, 5)
    other.commit()
    with pytest.raises(psycopg.errors.SerializationFailure):
        ROWS.claim(late.cursor(), 1, 10)
    late.rollback()
    ROWS.claim(late.cursor(), 1, 10)
    late.commit()
    assert pg.balance_and_fence() == (0, 10)


# -- FencedRows: configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "",
        "1accounts",
        "acc ounts",
        "accounts;DROP TABLE x",
        'a"b',
        "a.b.c",
        "a.",
        ".a",
        "a-b",
        None,
        5,
        b"id",
    ],
)
@pytest.mark.parametrize("where", ["table", "key", "fence"])
def test_bad_identifiers_are_config_errors(name: object, where: str) -> None:
    options: dict[str, Any] = {"table": "accounts", "key": "id", "fence": "fence", where: name}
    with pytest.raises(ConfigError, match=where):
        FencedRows(options.pop("table"), **options)


def test_good_identifiers_and_bad_columns() -> None:
    rows = FencedRows("ledger.accounts", key="_id2", fence="Fence_1")
    assert (rows.table, rows.key, rows.fence) == ("ledger.accounts", "_id2", "Fence_1")
    conn = sqlite3.connect(":memory:")
    try:
        cur = conn.cursor()
        with pytest.raises(ConfigError, match="column"):
            ROWS.update(cur, 1, 5, **{"balance = 0 --": 1})
        with pytest.raises(ConfigError, match="at least one"):
            ROWS.update(cur, 1, 5)
    finally:
        conn.close()


@pytest.mark.parametrize("fence", [0, -1, True, False, 1.5, 5.0, "5", None])
def test_fences_must_be_positive_ints(fence: object) -> None:
    conn = sqlite3.connect(":memory:")
    try:
        cur = conn.cursor()
        cur.execute(SCHEMA)
        cur.execute("INSERT INTO accounts (id) VALUES (1)")
        with pytest.raises(ConfigError, match="positive int"):
            ROWS.claim(cur, 1, fence)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="positive int"):
            ROWS.update(cur, 1, fence, balance=1)  # type: ignore[arg-type]
        assert cur.execute("SELECT balance, fence FROM accounts").fetchall() == [(0, 0)]
    finally:
        conn.close()


@pytest.mark.parametrize("style", ["dollar", "", "QMARK", 1, "pyformat "])
def test_bad_paramstyles_are_config_errors(style: object) -> None:
    with pytest.raises(ConfigError, match="paramstyle"):
        FencedRows("accounts", paramstyle=style)  # type: ignore[arg-type]


class WrappedCursor:
    """A cursor wrapper whose module is no DB-API driver (as ORMs and tracers hand out)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def execute(self, sql: str, params: Any = ()) -> WrappedCursor:
        self.inner.execute(sql, params)
        return self

    def fetchone(self) -> Any:
        return self.inner.fetchone()

    @property
    def rowcount(self) -> int:
        return int(self.inner.rowcount)


def _exercise(cur: Any, rows: FencedRows) -> None:
    """The whole contract through one cursor: accept, refuse, missing."""
    rows.claim(cur, 1, 5)
    rows.update(cur, 1, 5, balance=10, key="x")
    assert rows.current(cur, 1) == 5
    with pytest.raises(StaleFence) as refused:
        rows.update(cur, 1, 4, balance=99)
    assert refused.value.current == 5
    with pytest.raises(LookupError):
        rows.claim(cur, 2, 5)
    assert rows.current(cur, 2) is None


@pytest.mark.parametrize("style", [None, "qmark", "named", "numeric"])
def test_sqlite3_paramstyles(style: str | None) -> None:
    """sqlite3 says qmark; it also runs :name and :1 (format and pyformat it does not)."""
    conn = sqlite3.connect(":memory:")
    try:
        cur = conn.cursor()
        cur.execute(SCHEMA)
        cur.execute("INSERT INTO accounts (id) VALUES (1)")
        _exercise(cur, FencedRows("accounts", paramstyle=style))
        assert cur.execute("SELECT balance, key, fence FROM accounts").fetchall() == [(10, "x", 5)]
    finally:
        conn.close()


def test_a_wrapped_cursor_needs_an_explicit_paramstyle() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        cur = conn.cursor()
        cur.execute(SCHEMA)
        cur.execute("INSERT INTO accounts (id) VALUES (1)")
        with pytest.raises(ConfigError, match="paramstyle=") as unknown:
            ROWS.claim(WrappedCursor(cur), 1, 5)
        assert "WrappedCursor" in str(unknown.value)
        _exercise(WrappedCursor(cur), FencedRows("accounts", paramstyle="qmark"))
    finally:
        conn.close()


@pytest.mark.parametrize("style", [None, "pyformat", "format"])
def test_psycopg_paramstyles(pg_database: str, style: str | None) -> None:
    """psycopg 3 says pyformat (%(name)s); it also runs format (%s)."""
    import psycopg

    with psycopg.connect(pg_database) as conn:
        cur = conn.cursor()
        cur.execute(SCHEMA.replace("CREATE TABLE", "CREATE TEMPORARY TABLE"))
        cur.execute("INSERT INTO accounts (id) VALUES (1)")
        _exercise(cur, FencedRows("accounts", paramstyle=style))
        cur.execute("SELECT balance, key, fence FROM accounts")
        assert cur.fetchall() == [(10, "x", 5)]
        conn.rollback()


# -- FencedKey on a Redis data server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_server() -> Iterator[RedisServer]:
    """A Redis data server of its own: not one of the lock masters."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def data(data_server: RedisServer) -> Iterator[Any]:
    client = data_server.client()
    client.flushall()
    try:
        yield client
    finally:
        client.close()


def test_reading_an_absent_key_claims_it_and_returns_none(data: Any) -> None:
    # The script's reply shape, as redis-py hands it over: {1, false} arrives as [1, None].
    assert data.eval(scripts.FENCED_READ.source, 2, "raw", "raw~fence", "5") == [1, None]
    assert data.eval(scripts.FENCED_READ.source, 2, "raw", "raw~fence", "4") == [0, b"5"]
    key = FencedKey(data, "balance:1")
    assert key.current() is None
    assert key.read(5) is None
    assert data.exists("balance:1") == 0  # a claim writes the fence, never the data key
    assert data.get("balance:1~fence") == b"5"
    assert key.current() == 5


def test_write_and_read_with_fences(data: Any) -> None:
    key = FencedKey(data, "balance:1")
    key.write(5, "a")
    assert data.get("balance:1") == b"a"
    assert key.read(5) == b"a"  # equal: the writer reads its own write
    assert key.read(7) == b"a"  # higher: claims
    assert key.current() == 7
    key.write(7, b"b")
    key.write(7, "c")  # one holder, several writes
    assert key.read(8) == b"c"
    assert data.get("balance:1~fence") == b"8"


def test_a_stale_write_or_read_is_refused_and_changes_nothing(data: Any) -> None:
    key = FencedKey(data, "balance:1")
    key.write(7, "new")
    for attempt in (lambda: key.write(6, "old"), lambda: key.read(6), lambda: key.write(1, "old", px=50)):
        with pytest.raises(StaleFence) as refused:
            attempt()
        assert (refused.value.resource, refused.value.current) == ("balance:1", 7)
    assert data.get("balance:1") == b"new"
    assert data.pttl("balance:1") == -1
    assert data.get("balance:1~fence") == b"7"
    assert sorted(data.keys("*")) == [b"balance:1", b"balance:1~fence"]


def test_fences_compare_as_numbers_up_to_2_to_the_53(data: Any) -> None:
    key = FencedKey(data, "k")
    key.write(9, "nine")
    key.write(10, "ten")  # "10" < "9" as strings: the scripts compare numbers
    with pytest.raises(StaleFence):
        key.write(9, "nine again")
    big = 2**53 - 1
    key.write(big, "big")
    assert data.get("k~fence") == str(big).encode()  # stored as sent
    with pytest.raises(StaleFence) as refused:
        key.write(big - 1, "below")
    assert refused.value.current == big
    assert data.get("k") == b"big"


def test_px_is_honoured_and_the_fence_outlives_the_value(data: Any) -> None:
    key = FencedKey(data, "session")
    key.write(3, "v", px=400)
    assert 0 < data.pttl("session") <= 400
    wait_until(lambda: data.exists("session") == 0, 5, "expiry of the value")
    assert data.pttl("session~fence") == -1  # the fence must not expire with the value
    assert key.read(3) is None
    with pytest.raises(StaleFence):
        key.write(2, "late", px=400)
    assert data.exists("session") == 0
    key.write(4, "again", px=10_000)
    key.write(4, "no ttl")  # a write without px stores the value without one
    assert data.pttl("session") == -1


@pytest.mark.parametrize("px", [0, -1, True, 1.5, "100"])
def test_px_must_be_a_positive_int(data: Any, px: object) -> None:
    key = FencedKey(data, "session")
    with pytest.raises(ConfigError, match="px"):
        key.write(3, "v", px=px)  # type: ignore[arg-type]
    assert data.keys("*") == []


@pytest.mark.parametrize("fence", [0, -5, True, 2.0, "7", None])
def test_fencedkey_fences_must_be_positive_ints(data: Any, fence: object) -> None:
    key = FencedKey(data, "k")
    with pytest.raises(ConfigError, match="positive int"):
        key.read(fence)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="positive int"):
        key.write(fence, "v")  # type: ignore[arg-type]
    assert data.keys("*") == []


def test_the_fence_key_location(data: Any) -> None:
    tagged = FencedKey(data, "{user:1}:balance")
    assert tagged.fence_key == "{user:1}:balance~fence"  # same hash tag: same Cluster slot
    tagged.write(2, "x")
    assert sorted(data.keys("*")) == [b"{user:1}:balance", b"{user:1}:balance~fence"]
    own = FencedKey(data, "v", fence_key="fences:v")
    own.write(3, "y")
    assert data.get("fences:v") == b"3"
    assert data.exists("v~fence") == 0
    for bad in ("", "v", b"f", 3):
        with pytest.raises(ConfigError, match="fence_key"):
            FencedKey(data, "v", fence_key=bad)  # type: ignore[arg-type]
    for bad_key in ("", b"v", None):
        with pytest.raises(ConfigError, match="key"):
            FencedKey(data, bad_key)  # type: ignore[arg-type]


def test_a_decoding_client_reads_str(data_server: RedisServer) -> None:
    client = data_server.client(decode_responses=True)
    try:
        client.flushall()
        key = FencedKey(client, "text")
        key.write(1, "héllo")
        assert key.read(2) == "héllo"
        with pytest.raises(StaleFence) as refused:
            key.read(1)
        assert refused.value.current == 2
    finally:
        client.close()


# -- end to end: a real fenced lock, a holder that stalls past its TTL -----------------------------------


def test_the_readme_pattern_under_a_fenced_lock(rl: Redlock, tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "readme.sqlite3")
    try:
        conn.execute(SCHEMA)
        conn.execute("INSERT INTO accounts (id, balance) VALUES (42, 10)")
        conn.commit()
        rows, account_id, amount = ROWS, 42, 5
        for _ in range(2):
            # A timeout: the subject is the pattern, not one attempt (``rl`` makes one, and on a
            # loaded host the first round's connects can miss its request timeout).
            with rl.lock(f"account:{account_id}", fenced=True, timeout=5.0) as lock, conn:
                cur = conn.cursor()
                rows.claim(cur, account_id, lock.fence)
                (balance,) = cur.execute(
                    "SELECT balance FROM accounts WHERE id = ?", (account_id,)
                ).fetchone()
                rows.update(cur, account_id, lock.fence, balance=balance + amount)
            last = lock
        assert conn.execute("SELECT balance FROM accounts WHERE id = 42").fetchone() == (20,)
        stored = conn.execute("SELECT fence FROM accounts WHERE id = 42").fetchone()[0]
        assert stored > 0
        assert last.fence is None  # released
    finally:
        conn.close()


def test_fences_from_a_real_lock_refuse_a_holder_that_stalled_past_its_ttl(
    masters: ServerSet, data: Any, tmp_path: Path
) -> None:
    """Holder A takes the fenced lock (1 s TTL), claims the row and the key and reads, then
    stalls. B waits for A's lock to expire, takes it with a higher fence, credits 50 to both.
    A wakes up and writes its stale +100: both resources refuse it, naming B's fence."""
    path = tmp_path / "ledger.sqlite3"
    with sqlite3.connect(path) as setup:
        setup.execute(SCHEMA)
        setup.execute("INSERT INTO accounts (id) VALUES (1)")
    setup.close()
    key = FencedKey(data, "balance:1")
    name = f"account:e2e-{uuid.uuid4().hex[:8]}"

    def credit(conn: sqlite3.Connection, fence: int, amount: int) -> None:
        # The claim is committed on its own, so a holder stalled after it holds no database lock.
        with conn:
            ROWS.claim(conn.cursor(), 1, fence)
        (balance,) = conn.execute("SELECT balance FROM accounts WHERE id = 1").fetchone()
        with conn:
            ROWS.update(conn.cursor(), 1, fence, balance=balance + amount)

    with Redlock(masters.urls, retry_count=0) as a_side, Redlock(masters.urls) as b_side:
        a_conn = sqlite3.connect(path, timeout=10, check_same_thread=False)
        b_conn = sqlite3.connect(path, timeout=10, check_same_thread=False)
        try:
            lock_a = a_side.lock(name, ttl=1.0, fenced=True)
            assert take(lock_a), lock_a.last_error
            fence_a = lock_a.fence
            assert isinstance(fence_a, int)
            with a_conn:
                ROWS.claim(a_conn.cursor(), 1, fence_a)
            (a_balance,) = a_conn.execute("SELECT balance FROM accounts WHERE id = 1").fetchone()
            a_value = int(key.read(fence_a) or 0)

            def holder_b() -> int:
                lock_b = b_side.lock(name, ttl=5.0, fenced=True)
                assert lock_b.acquire(timeout=10), lock_b.last_error
                try:
                    fence_b = lock_b.fence
                    assert isinstance(fence_b, int)
                    credit(b_conn, fence_b, 50)
                    key.write(fence_b, str(int(key.read(fence_b) or 0) + 50))
                    return fence_b
                finally:
                    lock_b.release()

            started = time.monotonic()
            b = Outcome(holder_b)  # A "stalls" here: it does nothing until B is done
            fence_b = b.result(timeout=20)
            assert isinstance(fence_b, int)
            assert fence_b > fence_a
            assert time.monotonic() - started > 0.5  # B waited for A's TTL to run out
            assert not lock_a.owned() and lock_a.fence == fence_a  # lost, but the fence is kept

            with pytest.raises(StaleFence) as row_refused, a_conn:
                ROWS.update(a_conn.cursor(), 1, fence_a, balance=a_balance + 100)
            with pytest.raises(StaleFence) as key_refused:
                key.write(fence_a, str(a_value + 100))
            for refused in (row_refused.value, key_refused.value):
                assert (refused.fence, refused.current) == (fence_a, fence_b)
            assert a_conn.execute("SELECT balance, fence FROM accounts WHERE id = 1").fetchone() == (
                50,
                fence_b,
            )
            assert data.get("balance:1") == b"50"
        finally:
            a_conn.close()
            b_conn.close()


def test_a_fenced_lock_waits_for_a_release(rl: Redlock, masters: ServerSet) -> None:
    name = f"wait-{uuid.uuid4().hex[:8]}"
    # A fallback poll and a retry delay far longer than the test: only the release can wake it.
    with Redlock(masters.urls, retry_delay=10, wait_poll=8) as other:
        holder = rl.lock(name, ttl=5.0, fenced=True)
        assert take(holder)
        waiter = other.lock(name, ttl=5.0, fenced=True)
        pending = Outcome(lambda: waiter.acquire(timeout=10))
        time.sleep(0.2)  # the waiter is asleep in its room by then (not a synchronisation)
        released = time.monotonic()
        holder.release()
        assert pending.result() is True
        # Woken by the release: before any fallback poll (8 s) or retry (10 s) could have
        # tried again. How soon after it is the host's (a loaded one connects slowly).
        assert time.monotonic() - released < 7.0
        assert isinstance(waiter.fence, int)
        waiter.release()
