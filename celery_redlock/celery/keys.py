"""Lock names bound from a task call's arguments: ``"invoice:<invoice_id>"``.

**Placeholders.** A template's ``<name>`` placeholders are bound through the function's
signature, so the same call written positionally, by keyword or relying on a default names the
same resource; ``<invoice.id>`` goes on from there through attributes (or the keys of a dict, as
JSON delivers objects). Everything about a template is checked once, when the task class is
created, so a mistake fails at start-up with the task named rather than at run time: the first
segment of every placeholder must name a parameter; a placeholder written in another syntax
(``{invoice_id}``, ``%(invoice_id)s``, ``${invoice_id}``) would be literal text, one constant
name and so one lock for every call, and is refused with the ``<invoice_id>`` spelling shown; two
placeholders must be kept apart by a separator (below).

**Canonical values.** One resource has one name whatever type the caller used, and a str that
spells a scalar's text is that scalar, deliberately: an id reaches a task as ``42`` from code and
as ``"42"`` from a web form, and both must take one lock.

- Numbers by value, in plain decimal notation: ``42``, ``42.0``, ``Decimal("42.00")`` and ``"42"``
  are all ``42``; a float by its shortest round-trip text written out (``0.1``; ``1e-07`` is
  ``0.0000001``); ``nan``, ``inf`` and the non-finite Decimals as Python spells them. At most 4300
  digits, Python's own limit for int text.
- ``True``/``False`` as ``true``/``false``; an enum member as its value; a UUID lower-case,
  hyphenated; an aware datetime in UTC ISO 8601, a naive one, a date or a time in ISO 8601; a path
  as its text; bytes as the text they decode to in UTF-8.
- Tags no text can spell: ``None`` is ``%none``, the empty string ``%empty``, bytes that are not
  UTF-8 ``%x`` and their hex digits.
- Lists and tuples alike (JSON turns every tuple into a list) as ``[a,b]``; a set as the list of its
  items' texts, sorted; a dict as ``{k=v,...}``, its pairs sorted.
- Anything else is refused when a call is rendered: model instances and other classes, even those
  with a ``__str__`` of their own, since a label is not an identity (two invoices print "March").
  The error suggests an attribute path (``<invoice.id>``) or a callable ``lock_key``.

**Injectivity.** Two argument tuples get one name only when each argument is the same resource by
the equivalences above. Three rules keep that:

1. Every scalar's text escapes ``%`` and the brackets ``[ ] { }`` as ``%XX`` (its UTF-8 bytes in
   hex), so no text spells a tag, a list or a dict; inside a list or dict ``,`` and ``=`` are
   escaped too, so items and pairs split one way.
2. Between two placeholders the template has a *separator*: its text there contains a character
   that is not a letter, digit, ``%`` or bracket (``:`` is usual), with no bracket before it.
   ``<a><b>`` and ``<a>x<b>`` are refused: ("12", "3") and ("1", "23") would meet.
3. Outside a list or dict, a value's text also escapes the first separator of every gap of its
   template: ``"inv:<a>:<b>"`` names ``("1:2", "3")`` ``inv:1%3A2:3``. A template with one
   placeholder escapes nothing more, so ``invoice:<id>`` stays ``invoice:42``, ``invoice:INV-7``
   or ``invoice:2024-01-01T12:00:00+00:00``.

Why that suffices: a value's text has balanced brackets and no separator of its template outside
them, so reading a name from the left, each value ends just before the first separator found
outside brackets (less the gap's fixed text before its separator, which holds no bracket); the
split is unique, and each piece reads back to one value. Over-long names are shortened to a head
plus a SHA-256 digest by the Redlock core (:func:`celery_redlock.lock.redlock.lock_key`).
"""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import itertools
import math
import pathlib
import re
import uuid
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import Any

from ..errors import ConfigError

PLACEHOLDER = re.compile(r"<([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)>")

# Placeholders of other template languages; in a lock_key they would be literal text.
_FOREIGN = re.compile(
    r"\{\{?\s*(?P<brace>[A-Za-z_][\w.]*|\d*)\s*(?:![rsa])?(?::[^{}]*)?\}\}?"  # {x} {0} {} {{x}}
    r"|%\((?P<percent>[A-Za-z_][\w.]*)\)[#0\- +]*(?:\d+|\*)?(?:\.\d+)?[diouxXeEfFgGcrsa]"  # %(x)s
    r"|\$\{\s*(?P<dollar>[A-Za-z_][\w.]*)\s*\}"  # ${x}
    r"|\$(?P<bare>[A-Za-z_]\w*)"  # $x: only when x is a parameter, "$usd" may be literal
)

KeySpec = str | Callable[..., str] | None
_NO_KWARGS: Mapping[str, Any] = {}  # never written to

NONE = "%none"
EMPTY = "%empty"
_BRACKETS = "[]{}"
_ALWAYS = "%" + _BRACKETS  # escaped in every scalar's text
_INSIDE = _ALWAYS + ",="  # and inside a list or dict
_DIGITS_LIMIT = 4300  # Python's default cap on int <-> str conversions


class NoCanonicalText(TypeError):
    """A value of a type whose text cannot name a resource."""


def _escaper(chars: str) -> Callable[[str], str]:
    table = {ord(c): "".join(f"%{b:02X}" for b in c.encode()) for c in chars}
    search = re.compile("[" + "".join(re.escape(c) for c in chars) + "]").search

    def escape(text: str) -> str:
        # The usual id holds none of these: one scan in C, and the same object back. Letters and
        # digits are never escaped (no separator is one), so they need not even be searched.
        return text if text.isalnum() or not search(text) else text.translate(table)

    return escape


_TOP = _escaper(_ALWAYS)
_INNER = _escaper(_INSIDE)


def _plain_decimal(value: Decimal) -> str:
    """A finite Decimal in plain notation: no exponent, no trailing zeros, ``0`` unsigned.

    Written out from the digits rather than through ``normalize()``, which rounds to the context's
    28 digits and so would give two different numbers one text.
    """
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)  # finite
    if len(digits) + abs(exponent) > _DIGITS_LIMIT:
        raise ValueError(f"{value!r} has more than {_DIGITS_LIMIT} digits written out")
    coefficient = "".join(map(str, digits))
    if exponent >= 0:
        whole, fraction = coefficient + "0" * exponent, ""
    else:
        coefficient = coefficient.rjust(1 - exponent, "0")
        whole, fraction = coefficient[:exponent], coefficient[exponent:]
    text = (whole.lstrip("0") or "0") + ("." + fraction.rstrip("0") if fraction.rstrip("0") else "")
    return "-" + text if sign and text != "0" else text


def _render(value: object, escape: Callable[[str], str]) -> str:
    """The canonical text of one value; ``escape`` is its template's (or a container's)."""
    kind = type(value)  # the usual two first; subclasses and the rest take the isinstance chain
    if kind is int:
        return escape(str(value))
    if kind is str:
        return escape(value) if value else EMPTY  # type: ignore[arg-type]
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):  # before str and int: IntEnum and StrEnum are both
        return _render(value.value, escape)
    if isinstance(value, str):
        return _render(str.__str__(value), escape)  # its text, whatever __str__ it overrides
    if isinstance(value, int):
        return escape(int.__repr__(value))
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return escape(float.__repr__(value))  # nan, inf, -inf
        return escape(_plain_decimal(Decimal(float.__repr__(value))))
    if isinstance(value, Decimal):
        return escape(_plain_decimal(value) if value.is_finite() else Decimal.__str__(value))
    if isinstance(value, uuid.UUID):
        return escape(uuid.UUID.__str__(value))
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(dt.timezone.utc)
        return escape(value.isoformat())
    if isinstance(value, (dt.date, dt.time)):
        return escape(value.isoformat())
    if isinstance(value, pathlib.PurePath):
        return _render(str(value), escape)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return _render(raw.decode("utf-8"), escape)
        except UnicodeDecodeError:
            return "%x" + raw.hex()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join([_render(v, _INNER) for v in value]) + "]"
    if isinstance(value, (set, frozenset)):
        return "[" + ",".join(sorted([_render(v, _INNER) for v in value])) + "]"
    if isinstance(value, Mapping):
        pairs = [_render(k, _INNER) + "=" + _render(v, _INNER) for k, v in value.items()]
        return "{" + ",".join(sorted(pairs)) + "}"
    raise NoCanonicalText(
        f"a {kind.__qualname__} has no canonical text: its str() need not identify it (two "
        "objects may print alike, or one differently each time)"
    )


def render_value(value: object) -> str:
    """The canonical text of one argument value, as a one-placeholder template renders it."""
    return _render(value, _TOP)


def _follow(value: object, path: tuple[str, ...]) -> object:
    """``value.a.b`` for ``path`` ``("a", "b")``; a dict's key where an attribute is asked of it."""
    for name in path:
        if isinstance(value, Mapping):
            if name not in value:
                raise LookupError(f"the {type(value).__qualname__} has no key {name!r}")
            value = value[name]
        else:
            try:
                value = getattr(value, name)
            except AttributeError:
                raise LookupError(f"a {type(value).__qualname__} has no attribute {name!r}") from None
    return value


class LockKey:
    """A task's compiled ``lock_key``: call :meth:`render` with a call's arguments."""

    def __init__(
        self, spec: KeySpec, func: Callable[..., Any], task_name: str, *, bound: bool = False
    ) -> None:
        self.spec = spec
        self.task_name = task_name
        try:
            self.signature: inspect.Signature | None = inspect.signature(func)
        except (TypeError, ValueError):  # builtins without a signature: keys must not bind args
            self.signature = None
        if bound and self.signature is not None:
            # A bound task's first parameter is the task itself, never part of a call.
            self.signature = self.signature.replace(parameters=list(self.signature.parameters.values())[1:])
        params = self.signature.parameters if self.signature is not None else {}
        self.fields: tuple[str, ...] = ()
        # "a:<x>:<y.id>" -> ("a:", "x", ":", "y.id", ""): literal text at even indexes, fields at odd.
        self._pieces: tuple[str, ...] = ()
        # (piece index, parameter, attribute path) per placeholder
        self._slots: tuple[tuple[int, str, tuple[str, ...]], ...] = ()
        self._escape = _TOP
        # A signature of plain parameters (no *args, **kwargs, keyword- or positional-only) binds
        # by zip: the one fast path, beside inspect's bind as the general one, and checked against
        # it in the key tests. inspect's bind costs 2-6 us in a loop, and a key bound that way
        # measured 13 us per task inside a real worker (bench_celery); the zip costs a few hundred
        # ns, whether the call is positional, by keyword or leaves defaults out.
        self._plain: tuple[str, ...] | None = None
        self._names: frozenset[str] = frozenset()
        self._defaults: dict[str, Any] = {}
        if params and all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values()):
            self._plain = tuple(params)
            self._names = frozenset(params)
            self._defaults = {
                n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty
            }
        if spec is None or callable(spec):
            return
        if not isinstance(spec, str) or not spec:
            raise ConfigError(
                f"task {task_name!r}: lock_key must be a non-empty str template, a callable or "
                f"None, got {spec!r}"
            )
        self._pieces = tuple(PLACEHOLDER.split(spec))
        self.fields = self._pieces[1::2]
        self._check_syntax(params)
        if not self.fields:
            return
        self._slots = tuple(
            (i, self._pieces[i].split(".")[0], tuple(self._pieces[i].split(".")[1:]))
            for i in range(1, len(self._pieces), 2)
        )
        self._escape = self._separators()
        named = {
            n
            for n, p in params.items()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        }
        takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [self._pieces[i] for i, parameter, _ in self._slots if parameter not in named]
        if unknown and not takes_any_keyword:
            raise ConfigError(
                f"task {task_name!r}: lock_key {spec!r} has placeholder(s) "
                f"{', '.join('<' + f + '>' for f in unknown)} that name no parameter of "
                f"{getattr(func, '__qualname__', func)!r}; its parameters are "
                f"{', '.join(named) or '(none)'}"
            )

    def _check_syntax(self, params: Mapping[str, inspect.Parameter]) -> None:
        """Refuse placeholders of another syntax, showing the template as it should read."""
        positional = [n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        found: list[str] = []
        auto = itertools.count()  # "{}" fields number themselves, as str.format does

        def fix(match: re.Match[str]) -> str:
            if match["bare"] is not None and match["bare"] not in params:
                return match[0]  # "$usd" is text, unless the task has a parameter usd
            name = next(n for n in match.groupdict().values() if n is not None)
            if name == "" or name.isdigit():  # {} or {0}: a parameter by position
                index = next(auto) if name == "" else int(name)
                name = positional[index] if index < len(positional) else "name"
            found.append(match[0])
            return f"<{name}>"

        pieces = list(self._pieces)
        for i in range(0, len(pieces), 2):
            pieces[i] = _FOREIGN.sub(fix, pieces[i])
        if found:
            right = "".join(p if i % 2 == 0 else f"<{p}>" for i, p in enumerate(pieces))
            raise ConfigError(
                f"task {self.task_name!r}: lock_key {self.spec!r} writes a placeholder as "
                f"{', '.join(found)}, which is literal text here, so every call would share one "
                f"lock; placeholders are written in angle brackets: {right!r}"
            )

    def _separators(self) -> Callable[[str], str]:
        """Check that a separator keeps every two placeholders apart; the escape for values."""
        separators = ""
        for i in range(2, len(self._pieces) - 1, 2):  # the text between two placeholders
            gap = self._pieces[i]
            found = next((c for c in gap if c in _BRACKETS or not (c.isalnum() or c == "%")), None)
            if found is None or found in _BRACKETS:
                before, after = self._pieces[i - 1], self._pieces[i + 1]
                right = "".join(p if j % 2 == 0 else f"<{p}>" for j, p in enumerate(self._pieces[:i]))
                right += ":" + "".join(p if j % 2 == 0 else f"<{p}>" for j, p in enumerate(self._pieces[i:]))
                raise ConfigError(
                    f"task {self.task_name!r}: lock_key {self.spec!r} does not keep <{before}> and "
                    f"<{after}> apart by a separator (text between them with a character other "
                    "than letters, digits, % and brackets, before any bracket), so different "
                    f"values could meet in one name, as ('12', '3') and ('1', '23') would; e.g. "
                    f"{right!r}"
                )
            if found not in separators:
                separators += found
        return _escaper(_ALWAYS + separators) if separators else _TOP

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied, ``**kwargs`` flattened in."""
        if self.signature is None:
            return dict(kwargs)
        plain = self._plain
        if plain is not None and len(args) <= len(plain):
            values = dict(zip(plain, args))  # noqa: B905 (args may stop short; strict= costs 0.2 us)
            for name, value in kwargs.items():
                if name in values or name not in self._names:
                    break  # given twice, or unknown: inspect words the error
                values[name] = value
            else:
                if len(values) < len(plain):
                    for name, default in self._defaults.items():
                        values.setdefault(name, default)
                if len(values) == len(plain):  # else a parameter without default is missing
                    return values
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"task {self.task_name!r}: arguments do not fit its signature "
                f"({exc}), so lock_key cannot be bound"
            ) from exc
        bound.apply_defaults()
        values = dict(bound.arguments)
        for name, param in self.signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(name, {}))
        return values

    def render(self, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """The resource name for one call."""
        if self.spec is None:
            return self.task_name
        if callable(self.spec):
            name = self.spec(*args, **(kwargs or {}))
            if not isinstance(name, str) or not name:
                raise ConfigError(
                    f"task {self.task_name!r}: lock_key callable returned {name!r}; "
                    "it must return a non-empty str"
                )
            return name
        if not self.fields:
            return self.spec
        pieces = list(self._pieces)
        values = self.bind(args, kwargs or _NO_KWARGS)
        for i, parameter, path in self._slots:
            if parameter not in values:
                raise ConfigError(
                    f"task {self.task_name!r}: lock_key placeholder <{pieces[i]}> was not given in this call"
                )
            pieces[i] = self._text(pieces[i], values[parameter], path)
        return "".join(pieces)

    def _text(self, field: str, value: object, path: tuple[str, ...]) -> str:
        """One placeholder's text: its attribute path followed, the value rendered."""
        try:
            return _render(_follow(value, path) if path else value, self._escape)
        except NoCanonicalText as exc:
            raise ConfigError(
                f"task {self.task_name!r}: lock_key placeholder <{field}>: {exc}; name an attribute "
                f"that identifies it, e.g. <{field}.id>, or give lock_key a callable"
            ) from exc
        except (LookupError, ValueError, RecursionError) as exc:
            raise ConfigError(f"task {self.task_name!r}: lock_key placeholder <{field}>: {exc}") from exc
        except Exception as exc:  # a property that raised: still the key's failure, named so
            raise ConfigError(
                f"task {self.task_name!r}: lock_key placeholder <{field}>: reading it raised {exc!r}"
            ) from exc

    def __repr__(self) -> str:
        return f"<LockKey {self.task_name}: {self.spec!r}>"


def compile_lock_key(
    spec: KeySpec, func: Callable[..., Any], task_name: str, *, bound: bool = False
) -> LockKey:
    """Check ``spec`` against ``func``'s signature (raising :class:`ConfigError`) and compile it.

    ``bound``: ``func`` takes the task as its first parameter (``@app.task(bind=True)``).
    """
    return LockKey(spec, func, task_name, bound=bound)
