"""Lock names bound from a task call's arguments: ``"invoice:<invoice_id>"``.

**Templates.** A template's ``<name>`` placeholders are bound through the function's signature,
so the same call written positionally, by keyword or relying on a default names the same
resource; ``<invoice.id>`` goes on from there through attributes (or the keys of a dict, as JSON
delivers objects). Everything about a template is checked once, when the task class is created,
so a mistake fails at start-up with the task named rather than at run time:

- the first segment of every placeholder must name a parameter;
- a placeholder written in another syntax (``{invoice_id}``, ``%(invoice_id)s``, ``${invoice_id}``)
  would be literal text, one constant name and so one lock for every call: refused, with the
  ``<invoice_id>`` spelling shown;
- a ``<`` or ``>`` that is not part of a placeholder is refused, showing the placeholder it was
  likely meant as (``invoice:<invoice_id``, ``< invoice_id >``). A template cannot hold a literal
  angle bracket, and there is no escape for one: a stray bracket is almost always a misspelt
  placeholder, a doubling rule would be one more syntax to misread (``<<a>>``), and in a key an
  operator types into a shell, ``<`` and ``>`` are redirections. A callable ``lock_key`` may
  return any name;
- a literal ``%`` is refused: it begins the escapes and tags of values (below), so a literal one
  could spell a value's text (``x:%none`` is ``x:<a>`` with None);
- two placeholders must be kept apart by a *separator*: text between them holding a character
  other than an ASCII letter or digit (``<a>:<b>``, not ``<a><b>`` or ``<a>x<b>``: ("12", "3")
  and ("1", "23") would meet).

``lock_key=None`` locks the task as a whole, named ``%task:<task name>``; a callable's names are
its own, outside everything said here.

**Canonical values.** One resource has one name whatever type the caller used, and a str that
spells a scalar's text is that scalar, deliberately: an id reaches a task as ``42`` from code and
as ``"42"`` from a web form, and both must take one lock.

- Numbers by value, in plain decimal notation: ``42``, ``42.0``, ``Decimal("42.00")`` and ``"42"``
  are all ``42``; a float by its shortest round-trip text written out (``0.1``; ``1e-07`` is
  ``0.0000001``); ``nan``, ``inf`` and the non-finite Decimals as Python spells them. At most 4300
  digits, Python's own limit for int text.
- ``True``/``False`` as ``true``/``false`` (not ``1``/``0``); an enum member as its value; a UUID
  lower-case, hyphenated; an aware datetime in UTC ISO 8601, a naive one, a date or a time in ISO
  8601; a path as its text; bytes as the text they decode to in UTF-8.
- Anything else is refused when a call is rendered: model instances and other classes, even those
  with a ``__str__`` of their own, since a label is not an identity (two invoices print "March").
  The error suggests an attribute path (``<invoice.id>``) or a callable ``lock_key``.

**Escaping.** A value's text keeps the *safe* characters ``A-Z a-z 0-9 _ . -`` and writes every
other one as ``%XX``, its UTF-8 bytes in upper-case hex: ``invoice:42``, ``invoice:INV-7`` and
UUIDs read as they always did; ``"1:2"`` is ``1%3A2``, ``"café"`` ``caf%C3%A9``, a datetime
``2024-01-01T12%3A00%3A00%2B00%3A00``. The safe set is fixed ASCII, not ``str.isalnum()``, whose
answer for a character depends on the Unicode version of the Python asking: workers on two
Pythons must agree on every name. Where a template keeps two placeholders apart by ``_``, ``.``
or ``-``, its values escape that character too. Tags begin with ``%`` and a character no escape
begins with (escapes use ``0-9 A-F``):

- ``%none`` (None), ``%empty`` (the empty string), ``%x`` and the hex digits of bytes that are not
  UTF-8;
- ``%[a,b]`` for lists and tuples alike (JSON turns every tuple into a list), a set as the list of
  its items' texts sorted, ``%{k=v,...}`` for a dict, its pairs sorted; items are escaped as any
  value, so every unescaped ``, = [ ] { }`` inside is the structure's own;
- ``%sha256`` and 64 hex digits: a value whose text is longer than ``MAX_NAME_LENGTH`` (512), the
  longest name the Redlock core keeps whole, is named by the SHA-256 of its text (of the bytes,
  for bytes that are not UTF-8, each kind hashed apart) and never escaped: escaping a 10 MB
  argument costs up to seconds, its digest milliseconds. Over-long whole names are shortened by the
  core (:func:`celery_redlock.lock.resource.lock_key`); both rely on SHA-256 having no collision.

**INVARIANT: render is injective over (template, values).** Outside a callable:

1. *One template*: two calls get one name only when each argument is the same resource by the
   equivalences above.
2. *Any two templates*: a value never supplies a separator. Every character of a name other than
   a safe one, outside the ``%`` items of its values, is its template's literal text, in order;
   every ``%`` is a value's. So two templates can render one name only by spelling the same safe
   characters between the same separators: what one writes literally, the other gets from a value
   of that text (``invoice:<id>`` with 42 is ``invoice:42``, a key written twice; and
   ``inv:<a>-<b>`` with (1, 2) is ``inv:<a>`` with "1-2", as ``-`` is safe: keep placeholders
   apart by ``:`` where that matters). When each placeholder stands between separators (or the
   name's ends) and the literal text has no safe character, one name means one template and one
   resource per placeholder.
3. *The whole task*: no template renders ``%t`` (its literal text has no ``%``; a value's ``%`` is
   followed by its own ``0-9 A-F n e x s [ {``), so ``%task:kc.three`` never meets ``kc.<x>``
   with ``"three"``.

Why (1) holds: a value's text holds no separator of its template outside a ``%[...]`` or
``%{...}`` of its own, whose brackets balance. Reading a name from the left, each value ends just
before the first separator of the gap after it found outside such brackets (less the gap's fixed
text before that separator, which holds only letters and digits); the last ends where the fixed
tail begins. The split is unique; ``%XX`` decodes one way, the tags differ in their second
character, items and pairs split at the unescaped ``,`` and ``=``, and each text reads back to one
value.
"""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
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
from ..lock.resource import MAX_NAME_LENGTH

PLACEHOLDER = re.compile(r"<([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)>")
# A placeholder misspelt: left open, or with spaces inside its brackets ("<a", "< a >", "<a :").
_LOOSE = re.compile(r"<\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\s*>|\s*(?![\w.>]))")

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
WHOLE_TASK = "%task:"  # + the task's name: lock_key=None
DIGEST = "%sha256"  # + 64 hex digits: a value longer than MAX_NAME_LENGTH
_SAFE_PUNCTUATION = "_.-"  # with the ASCII letters and digits, kept as they are in values
_DIGITS_LIMIT = 4300  # Python's default cap on int <-> str conversions


class NoCanonicalText(TypeError):
    """A value of a type whose text cannot name a resource."""


def _digest(kind: bytes, data: bytes) -> str:
    """A long value's name: ``kind`` keeps a text's digest apart from raw bytes' digest."""
    digest = hashlib.sha256(kind)
    digest.update(data)
    return DIGEST + digest.hexdigest()


def _percent(match: re.Match[str]) -> str:
    return "%" + match[0].encode("utf-8", "surrogatepass").hex("%").upper()


def _escaper(also: str = "") -> Callable[[str], str]:
    """The escape of a value's text: everything but the safe characters (less ``also``)."""
    kept = "".join(c for c in _SAFE_PUNCTUATION if c not in also)
    unsafe = "[^A-Za-z0-9" + re.escape(kept) + "]"
    search = re.compile(unsafe).search
    sub = re.compile(unsafe + "+").sub
    ascii_table = {c: f"%{c:02X}" for c in range(128) if re.fullmatch(unsafe, chr(c))}
    limit = MAX_NAME_LENGTH

    def escape(text: str) -> str:
        # The usual id is safe: checks in C (isascii reads a flag), and the same object back.
        if text.isalnum() and text.isascii() and len(text) <= limit:
            return text
        if len(text) > limit:
            return _digest(b"t", text.encode("utf-8", "surrogatepass"))
        if not search(text):
            return text
        if text.isascii():  # a table lookup per character: 3x faster than sub on a short text
            return text.translate(ascii_table)
        return sub(_percent, text)  # bounded: at most `limit` characters

    return escape


_TOP = _escaper()


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
    """The canonical text of one value; ``escape`` is its template's."""
    kind = type(value)  # the usual two first; subclasses and the rest take the isinstance chain
    if kind is int:
        return escape(str(value))
    if kind is str:
        return escape(value) if value else EMPTY  # type: ignore[arg-type]
    if value is None:
        return NONE
    if isinstance(value, enum.Enum):  # before str and int: IntEnum and StrEnum are both
        return _render(value.value, escape)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _bytes(bytes(value), escape)
    text = _scalar_text(value)
    if text is None:
        return _container(value)
    return escape(text) if text else EMPTY


def _bytes(raw: bytes, escape: Callable[[str], str]) -> str:
    """Bytes as the text they decode to in UTF-8; other bytes as ``%x`` and their hex digits."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return _digest(b"x", raw) if 2 + 2 * len(raw) > MAX_NAME_LENGTH else "%x" + raw.hex()
    return escape(text) if text else EMPTY


def _scalar_text(value: object) -> str | None:
    """A scalar's text before escaping; None for a value that is not a scalar."""
    if isinstance(value, bool):  # before int, of which it is a subclass
        return "true" if value else "false"
    if isinstance(value, str):
        return str.__str__(value)  # its text, whatever __str__ it overrides
    if isinstance(value, (int, float, Decimal)):
        return _number_text(value)
    if isinstance(value, uuid.UUID):
        return uuid.UUID.__str__(value)
    if isinstance(value, (dt.date, dt.time)):  # a datetime is a date
        return _iso_text(value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return None


def _number_text(value: int | float | Decimal) -> str:
    """A number by its value, in plain decimal notation (non-finite ones as Python spells them)."""
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return float.__repr__(value)  # nan, inf, -inf
        return _plain_decimal(Decimal(float.__repr__(value)))
    return _plain_decimal(value) if value.is_finite() else Decimal.__str__(value)


def _iso_text(value: dt.date | dt.time) -> str:
    """ISO 8601; an aware datetime in UTC, so one instant has one text whatever its zone."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None and value.utcoffset() is not None:
        value = value.astimezone(dt.timezone.utc)
    return value.isoformat()


def _container(value: object) -> str:
    """A list's, set's or dict's text: ``%[a,b]``, ``%{k=v}``; its items escaped as any value."""
    if isinstance(value, (list, tuple)):
        return "%[" + ",".join([_render(v, _TOP) for v in value]) + "]"
    if isinstance(value, (set, frozenset)):
        return "%[" + ",".join(sorted([_render(v, _TOP) for v in value])) + "]"
    if isinstance(value, Mapping):
        pairs = [_render(k, _TOP) + "=" + _render(v, _TOP) for k, v in value.items()]
        return "%{" + ",".join(sorted(pairs)) + "}"
    raise NoCanonicalText(
        f"a {type(value).__qualname__} has no canonical text: its str() need not identify it (two "
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


def _call_signature(func: Callable[..., Any], bound: bool) -> inspect.Signature | None:
    """The parameters a call of the task passes; None where ``func`` has no signature."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # builtins without a signature: keys must not bind args
        return None
    if bound:
        # A bound task's first parameter is the task itself, never part of a call.
        return signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


class LockKey:
    """A task's compiled ``lock_key``: call :meth:`render` with a call's arguments."""

    def __init__(
        self, spec: KeySpec, func: Callable[..., Any], task_name: str, *, bound: bool = False
    ) -> None:
        self.spec = spec
        self.task_name = task_name
        self._whole = WHOLE_TASK + task_name  # lock_key=None: a name no template renders
        self.signature = _call_signature(func, bound)
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
        self._compile(spec, params, func)

    def _compile(self, spec: str, params: Mapping[str, inspect.Parameter], func: Callable[..., Any]) -> None:
        """Split the template into pieces, checked by every rule of the module docstring."""
        self._pieces = tuple(PLACEHOLDER.split(spec))
        self.fields = self._pieces[1::2]
        self._check_syntax(params)
        self._check_literal(params)
        if not self.fields:
            return
        self._slots = tuple(
            (i, self._pieces[i].split(".")[0], tuple(self._pieces[i].split(".")[1:]))
            for i in range(1, len(self._pieces), 2)
        )
        self._escape = self._separators()
        self._check_parameters(params, func)

    def _check_parameters(self, params: Mapping[str, inspect.Parameter], func: Callable[..., Any]) -> None:
        """Refuse a placeholder that names no parameter (any name may, with ``**kwargs``)."""
        named = {
            n
            for n, p in params.items()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        }
        takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [self._pieces[i] for i, parameter, _ in self._slots if parameter not in named]
        if unknown and not takes_any_keyword:
            raise ConfigError(
                f"task {self.task_name!r}: lock_key {self.spec!r} has placeholder(s) "
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
        also = ""
        for i in range(2, len(self._pieces) - 1, 2):  # the text between two placeholders
            gap = self._pieces[i]
            found = next((c for c in gap if not (c.isascii() and c.isalnum())), None)
            if found is None:
                before, after = self._pieces[i - 1], self._pieces[i + 1]
                right = "".join(p if j % 2 == 0 else f"<{p}>" for j, p in enumerate(self._pieces[:i]))
                right += ":" + "".join(p if j % 2 == 0 else f"<{p}>" for j, p in enumerate(self._pieces[i:]))
                raise ConfigError(
                    f"task {self.task_name!r}: lock_key {self.spec!r} does not keep <{before}> and "
                    f"<{after}> apart by a separator (text between them with a character other "
                    "than an ASCII letter or digit), so different values could meet in one name, "
                    f"as ('12', '3') and ('1', '23') would; e.g. {right!r}"
                )
            if found in _SAFE_PUNCTUATION and found not in also:
                also += found  # a character values keep: this template's values escape it
        return _escaper(also) if also else _TOP

    def _check_literal(self, params: Mapping[str, inspect.Parameter]) -> None:
        """Refuse a literal ``%``, and a ``<`` or ``>`` that is no placeholder's."""
        literal = "".join(self._pieces[0::2])
        if "%" in literal:
            raise ConfigError(
                f"task {self.task_name!r}: lock_key {self.spec!r} holds a literal '%', which begins "
                "the escapes and tags of values ('%3A', '%none'), so it could spell one; write the "
                "name without it, or give lock_key a callable"
            )
        if "<" not in literal and ">" not in literal:
            return

        def fix(match: re.Match[str]) -> str:  # a guess only where it names a parameter
            return f"<{match[1]}>" if match[1].split(".")[0] in params else match[0]

        pieces = list(self._pieces)
        for i in range(0, len(pieces), 2):
            pieces[i] = _LOOSE.sub(fix, pieces[i])
        right = "".join(p if i % 2 == 0 else f"<{p}>" for i, p in enumerate(pieces))
        if any(c in "<>" for c in "".join(PLACEHOLDER.split(right)[0::2])):
            example = next(iter(params), "name")
            raise ConfigError(
                f"task {self.task_name!r}: lock_key {self.spec!r} has a '<' or '>' that is not part "
                f"of a placeholder; a placeholder is a parameter's name (and attributes) in angle "
                f"brackets, nothing else inside, e.g. '<{example}>' or '<{example}.id>'; angle "
                "brackets cannot be literal text in a template (a callable lock_key can return any name)"
            )
        raise ConfigError(
            f"task {self.task_name!r}: lock_key {self.spec!r} has a '<' or '>' that is not part of "
            f"a placeholder; placeholders are closed, with nothing but the name inside: {right!r}"
        )

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
        """The resource name for one call; ``%task:<task name>`` for ``lock_key=None``."""
        if self.spec is None:
            return self._whole
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
