"""lock_key names across templates: angle brackets that form no placeholder, values that cannot
spell a template's separators, the whole-task name no template renders, long values, and the
names of safe values kept as they were (issue #14, items 5 and 6)."""

from __future__ import annotations

import functools
import math
import re
import uuid
from decimal import Decimal
from fractions import Fraction

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock import ConfigError, RedlockTask
from celery_redlock.celery.keys import LockKey, compile_lock_key, render_value
from celery_redlock.lock.resource import MAX_NAME_LENGTH, lock_key


def one(a: object) -> None: ...


def two(a: object, b: object) -> None: ...


def four(p0: object = None, p1: object = None, p2: object = None, p3: object = None) -> None: ...


def ab(a: object = None, b: object = None) -> None: ...


def render(template: str, *values: object) -> str:
    return compile_lock_key(template, four if "<p" in template else ab, "kt.render").render(values)


# -- item 6: a value cannot spell a separator; the whole-task name ------------------------------


def test_a_value_cannot_spell_the_separator_of_another_template() -> None:
    assert render("inv:<a>", "1:2") == "inv:1%3A2"
    assert render("inv:<a>:<b>", "1", "2") == "inv:1:2"
    assert render("files/<a>", "x/y") != render("files/<a>/<b>", "x", "y")
    assert render("inv:<a>", "1 2") != render("inv:<a> <b>", "1", "2")


def test_the_whole_task_name_is_one_no_template_renders() -> None:
    whole = compile_lock_key(None, one, "kc.three").render(("x",))
    assert whole == "%task:kc.three"
    assert whole != compile_lock_key("kc.<a>", one, "kc.other").render(("three",))
    assert whole != compile_lock_key("<a>", one, "kc.other").render(("kc.three",))
    assert whole != compile_lock_key("<a>", one, "kc.other").render(("%task:kc.three",))
    with pytest.raises(ConfigError, match="%"):
        compile_lock_key("%task:kc.three", one, "kc.other")


def test_a_task_without_lock_key_locks_the_whole_task_name() -> None:
    app = Celery("keys-render-test", set_as_current=False)

    @app.task(base=RedlockTask, name="kc.three", lazy=False, shared=False)
    def three(a: str) -> None: ...

    @app.task(base=RedlockTask, lock_key="kc.<a>", name="kc.other", lazy=False, shared=False)
    def other(a: str) -> None: ...

    assert three.lock_name(("x",)) == "%task:kc.three"
    assert three.lock_name(("x",)) != other.lock_name(("three",))


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("a:b", "a%3Ab"),
        ("50%", "50%25"),
        ("<x>", "%3Cx%3E"),
        ("job@2026-01-01", "job%402026-01-01"),
        ("1~queue", "1%7Equeue"),
        ("a b\tc\n", "a%20b%09c%0A"),
        ("\x00\x7f", "%00%7F"),
        ("café", "caf%C3%A9"),
        ("/srv/data", "%2Fsrv%2Fdata"),
        ("a,b=c[d]{e}", "a%2Cb%3Dc%5Bd%5D%7Be%7D"),
        ("%none", "%25none"),
        ("\ud800", "%ED%A0%80"),  # a lone surrogate (JSON can carry one) still names one thing
    ],
)
def test_every_character_outside_the_safe_set_is_percent_encoded(value: str, text: str) -> None:
    assert render_value(value) == text
    assert render("inv:<a>", value) == "inv:" + text


def test_no_value_spells_a_slot_or_a_key_kept_beside_a_lock() -> None:
    slot = "2026-01-01T10:05:00+00:00"
    assert "@" not in render("report:<a>", "x@" + slot)
    name = render("inv:<a>", "1~queue")
    assert "~" not in name and lock_key("redlock:", name) == "redlock:inv:1%7Equeue"


def test_scalars_keep_their_documented_equivalences() -> None:
    assert {render_value(v) for v in (1, 1.0, Decimal("1.00"), "1")} == {"1"}
    assert render_value(True) == render_value("true") == "true" != render_value(1)
    assert render_value(0.1) == "0.1" and render_value(1e-7) == "0.0000001"
    assert render_value(None) == "%none" != render_value("None") != render_value("none")
    assert render_value("") == "%empty" != render_value("%empty")
    assert render_value(uuid.UUID(int=1)) == "00000000-0000-0000-0000-000000000001"
    assert render_value(b"\xff") == "%xff" != render_value("\xff")


def test_lists_and_dicts_are_marked_so_literal_brackets_cannot_spell_them() -> None:
    assert render_value([1, 2]) == "%[1,2]"
    assert render_value((1, [2, 3])) == "%[1,%[2,3]]"
    assert render_value({"b": 1, "a": "x:y"}) == "%{a=x%3Ay,b=1}"
    assert render("x:<a>", [1, 2]) != render("x:[<a>,<b>]", 1, 2) == "x:[1,2]"
    assert render("x:<a>", {"k": 1}) != render("x:{<a>=<b>}", "k", 1)


# -- long values ------------------------------------------------------------------------------------


def test_a_long_value_is_named_by_its_digest_and_not_escaped() -> None:
    huge = "a:" * 5_000_000  # 10 MB, escaping it would cost seconds
    name = render("doc:<a>", huge)
    assert re.fullmatch(r"doc:%sha256[0-9a-f]{64}", name), name[:100]
    assert render("doc:<a>", huge + "b") != name
    assert render("doc:<a>", huge) == name
    exact = "a" * MAX_NAME_LENGTH
    assert render("doc:<a>", exact) == "doc:" + exact  # up to the core's limit: as it was
    assert render("doc:<a>", exact + "a").startswith("doc:%sha256")
    digits = "7" * (MAX_NAME_LENGTH + 1)
    assert render_value(digits) == render_value(int(digits)) == render_value(Decimal(digits))
    assert render_value(b"\xff" * 1000).startswith("%sha256") and render_value(
        b"\xfe" * 1000
    ) != render_value(b"\xff" * 1000)


def test_a_long_text_and_long_bytes_of_the_same_content_stay_apart() -> None:
    text = "\ud800" * 600  # encodes (surrogatepass) to bytes that are not UTF-8
    raw = text.encode("utf-8", "surrogatepass")
    assert render_value(text) != render_value(raw)


# -- item 5: angle brackets and % in a template -----------------------------------------------------


@pytest.mark.parametrize(
    ("template", "right"),
    [
        ("invoice:<invoice_id", "invoice:<invoice_id>"),
        ("invoice:< invoice_id >", "invoice:<invoice_id>"),
        ("invoice:<invoice_id :<amount>", "invoice:<invoice_id>:<amount>"),
        ("invoice:<invoice_id:<amount>", "invoice:<invoice_id>:<amount>"),
        ("invoice:<invoice.id", "invoice:<invoice.id>"),
    ],
)
def test_a_placeholder_misspelt_with_angle_brackets_fails_at_definition(template: str, right: str) -> None:
    app = Celery("keys-render-test", set_as_current=False)
    with pytest.raises(ConfigError, match=r"'kt\.angle'.*lock_key.*" + re.escape(repr(right))):

        @app.task(base=RedlockTask, lock_key=template, name="kt.angle", lazy=False, shared=False)
        def charge(invoice_id: int, amount: int = 0, invoice: object = None) -> None: ...


@pytest.mark.parametrize(
    "template",
    ["a>b", "<>", "<1>", "inv:<invoice-id>", "x<<invoice_id>>", "x:<invoice_id>>", "a<b c>", "<a.>"],
)
def test_an_angle_bracket_that_forms_no_placeholder_is_refused(template: str) -> None:
    with pytest.raises(ConfigError, match=r"'kt\.angle'.*lock_key.*'<invoice_id>'"):
        compile_lock_key(template, lambda invoice_id: None, "kt.angle")


@pytest.mark.parametrize("template", ["inv:50%:<a>", "x%none", "<a>%3A<b>", "100%"])
def test_a_literal_percent_is_refused(template: str) -> None:
    with pytest.raises(ConfigError, match=r"'kt\.pct'.*lock_key.*%"):
        compile_lock_key(template, two, "kt.pct")


@pytest.mark.parametrize("template", ["invoice:<invoice_id>", "inv-<a>", "k[<a>]", "<a>-<b>", "a<b>c"])
def test_well_formed_templates_are_accepted(template: str) -> None:
    compile_lock_key(template, lambda invoice_id=0, a=0, b=0: None, "kt.ok")


# -- backward compatibility: safe values render exactly as before -----------------------------------

safe_text = st.text(alphabet="ABCXYZabcxyz0189_.-", min_size=1, max_size=MAX_NAME_LENGTH)


@given(safe_text, safe_text, st.integers(-(10**30), 10**30), st.uuids())
@settings(max_examples=120, deadline=None)
def test_safe_values_render_as_before(a: str, b: str, n: int, u: uuid.UUID) -> None:
    assert render("invoice:<a>", a) == "invoice:" + a
    assert render("inv:<a>:<b>", a, b) == f"inv:{a}:{b}"
    assert render("inv:<a>:<b>", n, u) == f"inv:{n}:{u}"
    assert render("invoice:<a>", 42) == "invoice:42"


# -- the property: one name, one (template, resources) ----------------------------------------------
#
# What a value identifies, computed apart from the renderer: a number by its value, a str that
# spells a number's canonical text as that number, True/False as the words true/false, a tuple as
# the list of its items, a dict as the set of its pairs.

CANONICAL_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?")


def resource(value: object) -> object:
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("word", "true" if value else "false")
    if isinstance(value, int):
        return ("number", Fraction(value))
    if isinstance(value, float):
        return ("word", repr(value)) if not math.isfinite(value) else ("number", Fraction(repr(value)))
    if isinstance(value, Decimal):
        return ("number", Fraction(value)) if value.is_finite() else ("word", str(value))
    if isinstance(value, str):
        if CANONICAL_NUMBER.fullmatch(value) and value != "-0":
            return ("number", Fraction(value))
        return ("word", value)
    if isinstance(value, (list, tuple)):
        return ("list", tuple(resource(v) for v in value))
    if isinstance(value, dict):
        pairs = sorted(((resource(k), resource(v)) for k, v in value.items()), key=repr)
        return ("dict", tuple(pairs))
    raise AssertionError(f"no oracle for {value!r}")


# Text heavy in everything a renderer must escape, and in the texts of its own tags.
DANGEROUS = ":%<>@~ \t\n/,=[]{}é#"
tricky_text = st.one_of(
    st.text(alphabet=DANGEROUS + "-._aA1", max_size=5),
    st.sampled_from(["%none", "%empty", "%task:kc", "%3A", "%[1,2]", "%sha256", "%xff", "none", "true"]),
    st.sampled_from(["42", "42.0", "-0", "0.1", "x-y", "three", "kc.three", "1:2", "a@b", "1~queue"]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 42),
    tricky_text,
    st.decimals(min_value=-50, max_value=50, places=2),
    st.floats(allow_nan=True, allow_infinity=True),
)
argument = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(tricky_text, st.integers(0, 3)), inner, max_size=2),
    ),
    max_leaves=5,
)

# Literal text made of separators only: every character here is one a value never holds, or one
# a template may not hold at all (%, < and >, refused at definition).
separator_text = st.text(alphabet=DANGEROUS, min_size=1, max_size=3)


@st.composite
def separated_templates(draw: st.DrawFn) -> str:
    """A template whose literal text holds no letter, digit, _ . or -."""
    count = draw(st.integers(0, 3))
    pieces = [draw(st.one_of(st.just(""), separator_text))]
    for i in range(count):
        pieces.append(f"<p{i}>")
        last = i == count - 1
        pieces.append(draw(st.one_of(st.just(""), separator_text) if last else separator_text))
    return "".join(pieces) or draw(separator_text)


@functools.cache
def compiled(template: str) -> LockKey | None:
    """The template compiled; None where it is refused, which is only for a literal %, < or >
    or another syntax's placeholder (``{}``): a gap of separators always separates."""
    try:
        return compile_lock_key(template, four, "kt.any")
    except ConfigError as exc:
        literal = re.sub(r"<p\d>", "", template)
        assert set(literal) & set("%<>") or "writes a placeholder as" in str(exc), template
        return None


@given(st.lists(st.tuples(separated_templates(), st.lists(argument, min_size=3, max_size=3)), max_size=25))
@settings(max_examples=120, deadline=None)
def test_templates_of_separators_meet_only_when_template_and_resources_are_equal(
    calls: list[tuple[str, list[object]]],
) -> None:
    seen: dict[str, object] = {}
    for template, values in calls:
        key = compiled(template)
        if key is None:
            continue
        count = template.count("<p")
        name = key.render(tuple(values[:count]))
        meaning = (re.split(r"<p\d>", template), tuple(resource(v) for v in values[:count]))
        assert seen.setdefault(name, meaning) == meaning, (name, template, values)
        assert not name.startswith("%task:"), name


WORDS = ["42", "a", "x-y", "true", "none", "three", "kc.three", "0.1", "INV-7"]
plain_separators = st.text(alphabet=":@~ /,=[]{}é#", min_size=1, max_size=2)


@st.composite
def worded_templates(draw: st.DrawFn) -> tuple[str, list[object]]:
    """Words between separators, each a literal word or a placeholder: the template, and its
    parts (("sep", text), ("word", text), or the index of a placeholder)."""
    parts: list[object] = []
    if draw(st.booleans()):
        parts.append(("sep", draw(plain_separators)))
    placeholders = 0
    for _ in range(draw(st.integers(1, 4))):
        if placeholders < 4 and draw(st.booleans()):
            parts.append(placeholders)
            placeholders += 1
        else:
            parts.append(("word", draw(st.sampled_from(WORDS))))
        parts.append(("sep", draw(plain_separators)))
    if draw(st.booleans()):
        parts.pop()
    template = "".join(f"<p{p}>" if isinstance(p, int) else p[1] for p in parts)  # type: ignore[index]
    return template, parts


def reading(parts: list[object], values: list[object]) -> tuple[object, ...]:
    out: list[object] = []
    for part in parts:
        if isinstance(part, int):
            out.append(("value", resource(values[part])))
        elif part[0] == "word":  # type: ignore[index]
            out.append(("value", resource(part[1])))  # type: ignore[index]
        else:
            out.append(part)
    return tuple(out)


@given(st.lists(st.tuples(worded_templates(), st.lists(argument, min_size=4, max_size=4)), max_size=25))
@settings(max_examples=120, deadline=None)
def test_two_templates_meet_only_where_they_spell_the_same_words(
    calls: list[tuple[tuple[str, list[object]], list[object]]],
) -> None:
    """Between two separators a name holds one word, written in the template or brought by one
    value: ``invoice:<id>`` with 42 and ``invoice:42`` are one name, as they are one key written
    twice. Values never add, remove or move a separator, so nothing else ever meets."""
    names: dict[str, tuple[object, ...]] = {}
    readings: dict[tuple[object, ...], str] = {}
    for (template, parts), values in calls:
        key = compiled(template)
        if key is None:
            continue
        name = key.render(tuple(values[: template.count("<p")]))
        meaning = reading(parts, values)
        assert names.setdefault(name, meaning) == meaning, (name, template, values)
        assert readings.setdefault(meaning, name) == name, (meaning, template, values)


def test_what_two_templates_share_is_text_they_both_spell() -> None:
    """The one way two templates meet: one writes as literal text what the other gets from a
    value of that text. Safe values read as they are, so this cannot be told apart, and it is
    one key written twice; a template that keeps placeholders apart by ``_ . -`` meets a value
    holding that character in another template, hence ``:`` as the usual separator."""
    assert render("invoice:<a>", 42) == compile_lock_key("invoice:42", ab, "kt.const").render(())
    assert render("inv:<a>", "1-2") == render("inv:<a>-<b>", 1, 2) == "inv:1-2"
    assert render("inv:<a>-<b>", "1-2", 3) == "inv:1%2D2-3"  # within the template, never
