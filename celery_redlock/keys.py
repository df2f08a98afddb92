"""Lock names bound from a task call's arguments: ``"invoice:<invoice_id>"``.

A template's ``<name>`` placeholders are bound through the function's signature, so the same
call written positionally, by keyword or relying on a default names the same resource. Every
placeholder must name a parameter; that is checked once, when the task class is created, so a typo
fails at start-up with the task and placeholder named rather than at run time.

Values are rendered canonically, so one resource has one name whatever type the caller used:
``42``, ``42.0``, ``Decimal("42.00")`` and ``"42"`` all render ``42``; UUIDs in their lower-case
hyphenated form; aware datetimes in UTC ISO 8601; bytes as UTF-8 (hex when not text); lists,
tuples and sets element-wise, comma-joined (sets sorted); dicts as sorted ``k=v`` pairs. An object
without a ``__str__`` of its own is refused: its default ``<object at 0x...>`` would name a
different resource on every call and lock nothing. Over-long names are shortened to a head plus a
SHA-256 digest by the Redlock core (:func:`celery_redlock.redlock.lock_key`).
"""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import re
import uuid
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from .errors import ConfigError

PLACEHOLDER = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")

KeySpec = str | Callable[..., str] | None


def render_value(value: object) -> str:
    """The canonical text of one argument value inside a lock name."""
    kind = type(value)  # the two usual cases first (subclasses such as bool take the long way)
    if kind is str:
        return value  # type: ignore[return-value]
    if kind is int:
        return str(value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return render_value(value.value)
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, Decimal):
        if value.is_finite() and value == value.to_integral_value():
            return str(int(value))
        return str(value.normalize())
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(dt.timezone.utc)
        return value.isoformat()
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.hex()
    if isinstance(value, (list, tuple)):
        return ",".join(render_value(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return ",".join(sorted(render_value(v) for v in value))
    if isinstance(value, Mapping):
        return ",".join(sorted(f"{render_value(k)}={render_value(v)}" for k, v in value.items()))
    if type(value).__str__ is object.__str__ and type(value).__repr__ is object.__repr__:
        raise TypeError(
            f"{type(value).__qualname__} has no __str__ of its own; its default text differs "
            "per object and would lock nothing"
        )
    return str(value)


class LockKey:
    """A task's compiled ``lock_key``: call :meth:`render` with a call's arguments."""

    def __init__(self, spec: KeySpec, func: Callable[..., Any], task_name: str, *,
                 bound: bool = False) -> None:
        self.spec = spec
        self.task_name = task_name
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):  # builtins without a signature: keys must not bind args
            self.signature = None
        if bound and self.signature is not None:
            # A bound task's first parameter is the task itself, never part of a call.
            self.signature = self.signature.replace(
                parameters=list(self.signature.parameters.values())[1:]
            )
        self.fields: tuple[str, ...] = ()
        # A signature of plain parameters only (no *args, **kwargs, keyword- or positional-only)
        # binds by zip on the hot path; anything else goes through inspect's full bind.
        self._plain: tuple[str, ...] | None = None
        self._defaults: dict[str, Any] = {}
        if self.signature is not None and all(
            p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            for p in self.signature.parameters.values()
        ):
            self._plain = tuple(self.signature.parameters)
            self._defaults = {
                n: p.default for n, p in self.signature.parameters.items()
                if p.default is not inspect.Parameter.empty
            }
        self._pieces: tuple[str, ...] = ()
        self._positional: tuple[tuple[int, int], ...] | None = None
        if spec is None:
            return
        if callable(spec):
            return
        if not isinstance(spec, str) or not spec:
            raise ConfigError(
                f"task {task_name!r}: lock_key must be a non-empty str template, a callable or "
                f"None, got {spec!r}"
            )
        self.fields = tuple(PLACEHOLDER.findall(spec))
        if not self.fields:
            return
        # "a:<x>:<y>" -> ("a:", "x", ":", "y", ""): literal text at even indexes, fields at odd.
        self._pieces = tuple(PLACEHOLDER.split(spec))
        # (piece index, argument index) per placeholder, for a call that passes every parameter
        # positionally: the usual ``task.delay(a, b)`` needs no binding at all.
        if self._plain is not None and all(f in self._plain for f in self.fields):
            self._positional = tuple(
                (i, self._plain.index(self._pieces[i])) for i in range(1, len(self._pieces), 2)
            )
        params = self.signature.parameters if self.signature is not None else {}
        named = {
            n for n, p in params.items()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        }
        takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [f for f in self.fields if f not in named]
        if unknown and not takes_any_keyword:
            raise ConfigError(
                f"task {task_name!r}: lock_key {spec!r} has placeholder(s) "
                f"{', '.join('<' + f + '>' for f in unknown)} that name no parameter of "
                f"{getattr(func, '__qualname__', func)!r}; its parameters are "
                f"{', '.join(named) or '(none)'}"
            )

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied, ``**kwargs`` flattened in."""
        if self.signature is None:
            return dict(kwargs)
        plain = self._plain
        if plain is not None and len(args) <= len(plain):
            values = dict(zip(plain, args, strict=False))  # args may stop short
            for name, value in kwargs.items():
                if name in values or name not in plain:
                    break  # given twice, or unknown: let inspect word the error
                values[name] = value
            else:
                if len(values) < len(plain):
                    for name, default in self._defaults.items():
                        values.setdefault(name, default)
                if len(values) == len(plain):
                    return values
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"task {self.task_name!r}: arguments do not fit its signature "
                              f"({exc}), so lock_key cannot be bound") from exc
        bound.apply_defaults()
        values = dict(bound.arguments)
        for name, param in self.signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(name, {}))
        return values

    def render(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The resource name for one call."""
        kwargs = kwargs or {}
        if self.spec is None:
            return self.task_name
        if callable(self.spec):
            name = self.spec(*args, **kwargs)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"task {self.task_name!r}: lock_key callable returned {name!r}; "
                                  "it must return a non-empty str")
            return name
        if not self.fields:
            return self.spec
        if not kwargs and self._positional is not None and len(args) == len(self._plain or ()):
            pieces = list(self._pieces)
            for i, index in self._positional:
                pieces[i] = self._render_field(pieces[i], args[index])
            return "".join(pieces)
        values = self.bind(args, kwargs)
        pieces = list(self._pieces)
        for i in range(1, len(pieces), 2):
            field = pieces[i]
            if field not in values:
                raise ConfigError(f"task {self.task_name!r}: lock_key placeholder <{field}> "
                                  "was not given in this call")
            pieces[i] = self._render_field(field, values[field])
        return "".join(pieces)

    def _render_field(self, field: str, value: object) -> str:
        try:
            return render_value(value)
        except TypeError as exc:
            raise ConfigError(f"task {self.task_name!r}: lock_key placeholder <{field}>: "
                              f"{exc}") from exc

    def __repr__(self) -> str:
        return f"<LockKey {self.task_name}: {self.spec!r}>"


def compile_lock_key(spec: KeySpec, func: Callable[..., Any], task_name: str, *,
                     bound: bool = False) -> LockKey:
    """Check ``spec`` against ``func``'s signature (raising :class:`ConfigError`) and compile it.

    ``bound``: ``func`` takes the task as its first parameter (``@app.task(bind=True)``).
    """
    return LockKey(spec, func, task_name, bound=bound)
