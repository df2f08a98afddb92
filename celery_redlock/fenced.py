"""The resource side of fencing: refuse a write that carries an older fence than one seen.

A fenced lock (``Redlock.lock(name, fenced=True)``, or ``lock_fenced=True`` on a task) gives each
grant ``lock.fence``, an int above every earlier grant's. The lock cannot stop a holder that
paused after its last check from writing late; the resource can, by keeping the highest fence
it has seen and refusing lower ones. These helpers do that for the two resources users have
most. Both raise :class:`~celery_redlock.errors.StaleFence` for a stale write, and neither
imports a driver: they take the cursor or client you already have.

**A SQL row** (:class:`FencedRows`): the table gets a column ``fence BIGINT NOT NULL DEFAULT 0``.

- A single statement (``balance = balance + :x``) needs only :meth:`FencedRows.update`:
  ``UPDATE t SET ..., fence = :f WHERE id = :id AND fence <= :f``.
- A read-modify-write in application code must **claim** first: :meth:`FencedRows.claim`, then
  the ``SELECT``, then :meth:`FencedRows.update`. Without the claim, a stale holder that read
  before the new holder's first write can still write before it (the row has not seen the
  higher fence yet), and the new holder's update is lost. **Commit the claim on its own**, then
  read and update in a second transaction: the update re-checks the fence, so this is as safe,
  and a holder paused between the two keeps no row lock (in one transaction, a paused holder
  would hold the row's write lock, and its successor would wait on it until a lock timeout).
  PostgreSQL re-checks the WHERE clause when a concurrent claim commits (READ COMMITTED; under
  REPEATABLE READ the loser gets a serialization failure, and its retry ``StaleFence``); SQLite
  serializes writers.

``<=``, not ``<``: one holder may write several times; two grants never share a fence.

**A Redis key on a data server** (:class:`FencedKey`): the fence is kept at ``key + "~fence"``
(a suffix keeps a ``{hash tag}``, so under Cluster both keys share a slot). :meth:`FencedKey.read`
claims and reads in one script, :meth:`FencedKey.write` writes only under a fence not below the
stored one.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from .errors import ConfigError, StaleFence
from .lock import scripts

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")
_PARAMSTYLES = ("qmark", "format", "pyformat", "numeric", "named")


def _identifier(what: str, value: object) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise ConfigError(
            f"{what} must be a plain SQL identifier (letters, digits, _; schema.name), got {value!r}"
        )
    return value


def _fence(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"fence must be a positive int (a fenced lock's lock.fence), got {value!r}")
    return value


class FencedRows:
    """Fenced writes to the rows of one SQL table, through any DB-API cursor (never commits).

    ``paramstyle`` defaults to the cursor's driver module's (``qmark`` for sqlite3, ``pyformat``
    for psycopg); pass it for a wrapped cursor.
    """

    def __init__(
        self, table: str, *, key: str = "id", fence: str = "fence", paramstyle: str | None = None
    ) -> None:
        self.table = _identifier("table", table)
        self.key = _identifier("key", key)
        self.fence = _identifier("fence", fence)
        if paramstyle is not None and paramstyle not in _PARAMSTYLES:
            raise ConfigError(f"paramstyle must be one of {', '.join(_PARAMSTYLES)}, got {paramstyle!r}")
        self.paramstyle = paramstyle

    def claim(self, cursor: Any, key: object, fence: int) -> None:
        """Raise the row's fence to ``fence`` (or keep it, if equal): the first statement of a
        read-modify-write. :class:`StaleFence` if a higher fence has been there;
        :class:`LookupError` if there is no such row."""
        self._write(cursor, key, _fence(fence), {})

    def update(self, cursor: Any, key: object, fence: int, /, **values: object) -> None:
        """``UPDATE`` the row's ``values`` and its fence, only if its fence is not above
        ``fence``. :class:`StaleFence` if it is; :class:`LookupError` if there is no such row.
        (Positional-only, so that columns named ``key``, ``fence`` or ``cursor`` can be set.)"""
        if not values:
            raise ConfigError("update needs at least one column=value")
        for column in values:
            _identifier("column", column)
            if column == self.fence:
                raise ConfigError(f"update sets the fence column {column!r} itself; pass the fence only")
        self._write(cursor, key, _fence(fence), values)

    def current(self, cursor: Any, key: object) -> int | None:
        """The row's fence, or None if there is no such row."""
        sql, params = self._sql(
            cursor, f"SELECT {self.fence} FROM {self.table} WHERE {self.key} = ", [("key", key)], ""
        )
        cursor.execute(sql, params)
        row = cursor.fetchone()
        if row is None:
            return None
        if row[0] is None:
            # NULL <= fence is never true: every fenced write to this row would be refused.
            raise ConfigError(
                f"{self.table}.{self.fence} is NULL for {self.key} = {key!r}; declare it "
                "BIGINT NOT NULL DEFAULT 0"
            )
        return int(row[0])

    def _write(self, cursor: Any, key: object, fence: int, values: dict[str, object]) -> None:
        assignments = [*values.items(), (self.fence, fence)]
        set_clause = ", ".join(f"{column} = \0" for column, _ in assignments)
        template = f"UPDATE {self.table} SET {set_clause} WHERE {self.key} = \0 AND {self.fence} <= \0"
        params = [(f"v{i}", value) for i, (_, value) in enumerate(assignments)]
        sql, bound = self._bind(cursor, template, [*params, ("key", key), ("fence", fence)])
        cursor.execute(sql, bound)
        if cursor.rowcount == 1:
            return
        # Only the refusal pays for a lookup. An equal fence is a success: MySQL counts changed
        # rows, so a re-claim with the same fence can answer 0.
        current = self.current(cursor, key)
        if current is None:
            raise LookupError(f"{self.table}: no row with {self.key} = {key!r}")
        if current > fence:
            raise StaleFence(f"{self.table}[{self.key}={key!r}]", fence, current)
        if current < fence:
            # Not refused, yet not written: the row changed between the two statements (a
            # driver without row locks under this isolation). Nothing was lost; say so loudly.
            raise RuntimeError(
                f"{self.table}[{self.key}={key!r}]: the fenced update matched no row although the "
                f"row's fence ({current}) is not above {fence}; retry the transaction"
            )

    def _sql(self, cursor: Any, head: str, params: list[tuple[str, object]], tail: str) -> tuple[str, Any]:
        return self._bind(cursor, head + "\0" + tail, params)

    def _bind(self, cursor: Any, template: str, params: list[tuple[str, object]]) -> tuple[str, Any]:
        """Put the driver's placeholders where the template has NULs; the values as it wants them."""
        style = self.paramstyle or _driver_paramstyle(cursor)
        pieces = template.split("\0")
        out = [pieces[0]]
        for i, (piece, (name, _)) in enumerate(zip(pieces[1:], params, strict=True)):
            marker = {
                "qmark": "?",
                "format": "%s",
                "pyformat": f"%({name})s",
                "numeric": f":{i + 1}",
                "named": f":{name}",
            }[style]
            out.append(marker + piece)
        sql = "".join(out)
        if style in ("pyformat", "named"):
            return sql, {name: value for name, value in params}
        return sql, tuple(value for _, value in params)


def _driver_paramstyle(cursor: Any) -> str:
    module = sys.modules.get(type(cursor).__module__.split(".")[0])
    style = getattr(module, "paramstyle", None)
    if style not in _PARAMSTYLES:
        raise ConfigError(
            f"cannot tell the paramstyle of a {type(cursor).__module__}.{type(cursor).__name__} cursor; "
            "pass FencedRows(..., paramstyle=...)"
        )
    return str(style)


class FencedKey:
    """A key on a Redis data server (``redis.Redis`` client) guarded by fences."""

    def __init__(self, client: Any, key: str, fence_key: str | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"key must be a non-empty str, got {key!r}")
        if fence_key is not None and (not isinstance(fence_key, str) or not fence_key or fence_key == key):
            raise ConfigError(f"fence_key must be a non-empty str other than the key, got {fence_key!r}")
        self.client = client
        self.key = key
        self.fence_key = fence_key if fence_key is not None else key + "~fence"

    def read(self, fence: int) -> bytes | str | None:
        """Claim the key for ``fence``, then read it (None if absent; ``str`` from a client with
        ``decode_responses=True``), in one script. :class:`StaleFence` if a higher fence has been
        seen."""
        reply = self.client.eval(scripts.FENCED_READ.source, 2, self.key, self.fence_key, str(_fence(fence)))
        if reply[0] != 1:
            raise StaleFence(self.key, fence, int(reply[1]))
        # {1, false} for an absent key arrives as [1, None]; a shorter reply is read the same way.
        value: bytes | str | None = reply[1] if len(reply) > 1 else None
        return value

    def write(self, fence: int, value: bytes | str, *, px: int | None = None) -> None:
        """Set the key to ``value`` (with a TTL of ``px`` ms, if given) under ``fence``.
        :class:`StaleFence` if a higher fence has been seen."""
        if px is not None and (isinstance(px, bool) or not isinstance(px, int) or px <= 0):
            # '0' is the script's "no TTL": a px of 0 must not silently mean "keep forever".
            raise ConfigError(f"px must be a positive int of milliseconds or None, got {px!r}")
        ttl = "0" if px is None else str(px)
        reply = self.client.eval(
            scripts.FENCED_WRITE.source, 2, self.key, self.fence_key, str(_fence(fence)), value, ttl
        )
        if reply[0] != 1:
            raise StaleFence(self.key, fence, int(reply[1]))

    def current(self) -> int | None:
        """The highest fence the key has seen, or None."""
        stored = self.client.get(self.fence_key)
        return None if stored is None else int(stored)
