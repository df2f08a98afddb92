"""lock_key templates: binding through the signature, canonical values, definition-time errors."""

from __future__ import annotations

import datetime as dt
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
from celery_redlock.celery.keys import compile_lock_key, render_value
from celery_redlock.celery.slots import slot_name

# CI runs this file on every claimed Python and on the lowest versions (.ci/run, steps 2 and 3).
pytestmark = pytest.mark.versions


def charge(invoice_id: int, amount: int = 0, *, currency: str = "EUR") -> None: ...


def test_positional_keyword_and_default_binding_name_one_resource() -> None:
    key = compile_lock_key("invoice:<invoice_id>:<currency>", charge, "charge")
    assert key.render((42,)) == "invoice:42:EUR"
    assert key.render((), {"invoice_id": 42}) == "invoice:42:EUR"
    assert key.render((42, 5), {"currency": "USD"}) == "invoice:42:USD"


def test_values_render_canonically() -> None:
    assert {render_value(v) for v in (42, 42.0, Decimal("42.00"), "42")} == {"42"}
    assert render_value(uuid.UUID(int=1)) == "00000000-0000-0000-0000-000000000001"
    paris = dt.timezone(dt.timedelta(hours=1))
    assert render_value(dt.datetime(2024, 1, 1, 13, 0, tzinfo=paris)) == "2024-01-01T12%3A00%3A00%2B00%3A00"
    assert render_value(True) == "true" and render_value(None) == "%none"
    assert render_value({"b": 1, "a": 2}) == "%{a=2,b=1}"
    with pytest.raises(TypeError, match="no canonical text"):
        render_value(object())


def test_callable_key_gets_the_call_arguments() -> None:
    key = compile_lock_key(lambda invoice_id, **kw: f"inv-{invoice_id}", charge, "charge")
    assert key.render((7,), {"amount": 3}) == "inv-7"


def test_bad_placeholder_fails_when_the_task_is_defined() -> None:
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigError, match=r"'keys_test.charge'.*<invoce_id>"):

        @app.task(
            base=RedlockTask,
            lock_key="invoice:<invoce_id>",
            name="keys_test.charge",
            lazy=False,
            shared=False,
        )
        def bad(invoice_id: int) -> None: ...


def test_bound_task_skips_self() -> None:
    app = Celery("keys-test", set_as_current=False)

    @app.task(
        base=RedlockTask, bind=True, lock_key="acct:<account>", name="kt.bound", lazy=False, shared=False
    )
    def bound(self: RedlockTask, account: str) -> None: ...

    assert bound.lock_name(("a1",)) == "acct:a1"
    # lock_key=None: test_celery_keys_render.py::test_a_task_without_lock_key_locks_the_whole_task_name


def test_bad_option_values_name_the_task_and_option() -> None:
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigError, match=r"'kt.opt': lock_contended"):

        @app.task(base=RedlockTask, lock_contended="queue", name="kt.opt", lazy=False, shared=False)
        def opt() -> None: ...


def test_slots_align_to_the_epoch_and_to_cron_fire_times() -> None:
    from celery.schedules import crontab

    # A beat sends a tick at or after its boundary, never before: every send from the boundary up
    # to the next one is that tick's, however late; the next tick differs.
    base = 1_700_000_040.0  # a multiple of 60
    assert slot_name(60, base) == slot_name(60, base + 9) == slot_name(60, base + 59.9)
    assert slot_name(60, base + 59.9) != slot_name(60, base + 60)
    assert slot_name(60, base - 0.1) != slot_name(60, base)
    every5 = crontab(minute="*/5")
    fire = dt.datetime(2024, 1, 1, 10, 5, tzinfo=dt.timezone.utc).timestamp()
    assert slot_name(every5, fire + 1) == slot_name(every5, fire + 290) == "2024-01-01T10:05:00+00:00"
    assert slot_name(every5, fire - 3) == "2024-01-01T10:00:00+00:00"


def test_binding_agrees_with_inspect_for_every_way_of_calling() -> None:
    import inspect

    from celery_redlock.celery.keys import compile_lock_key

    def charge(invoice_id: int, amount: int = 0, currency: str = "EUR") -> None: ...

    key = compile_lock_key("inv:<invoice_id>:<currency>", charge, "kt.charge")
    signature = inspect.signature(charge)
    for args, kwargs in [
        ((1,), {}),
        ((1, 5), {}),
        ((1,), {"currency": "USD"}),
        ((), {"invoice_id": 1, "amount": 5}),
        ((1, 2, "GBP"), {}),
        ((), {"currency": "USD", "invoice_id": 2, "amount": 3}),
    ]:
        expected = signature.bind(*args, **kwargs)
        expected.apply_defaults()
        assert key.bind(args, kwargs) == dict(expected.arguments), (args, kwargs)
        # Every parameter given positionally takes a path of its own that binds nothing.
        named = expected.arguments
        assert key.render(args, kwargs) == f"inv:{named['invoice_id']}:{named['currency']}"
    for args, kwargs in [
        ((1, 2, "GBP", 4), {}),
        ((1,), {"invoice_id": 2}),
        ((), {"amount": 1}),
        ((1,), {"invoce_id": 1}),
    ]:
        with pytest.raises(ConfigError, match="do not fit its signature"):
            key.render(args, kwargs)


# -- a template names one resource per argument tuple (issue #14, item 6) ---------------------------


@pytest.mark.parametrize(
    ("template", "right"),
    [
        ("invoice:{invoice_id}", "invoice:<invoice_id>"),
        ("invoice:{ invoice_id }", "invoice:<invoice_id>"),
        ("invoice:%(invoice_id)s", "invoice:<invoice_id>"),
        ("invoice:%(invoice_id)d", "invoice:<invoice_id>"),
        ("invoice:${invoice_id}", "invoice:<invoice_id>"),
        ("invoice:$invoice_id", "invoice:<invoice_id>"),
        ("invoice:{{invoice_id}}", "invoice:<invoice_id>"),
        ("invoice:{}", "invoice:<invoice_id>"),
        ("invoice:{0}:<amount>", "invoice:<invoice_id>:<amount>"),
        ("invoice:{invoice.id}", "invoice:<invoice.id>"),
    ],
)
def test_another_placeholder_syntax_fails_at_definition_and_shows_the_right_one(
    template: str, right: str
) -> None:
    """Any other syntax would be literal text: one constant name, one lock for every call."""
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigError, match=re.escape(repr(right))):

        @app.task(base=RedlockTask, lock_key=template, name="kt.syntax", lazy=False, shared=False)
        def charge(invoice_id: int, amount: int = 0) -> None: ...


def test_dollar_text_that_names_no_parameter_is_literal() -> None:
    key = compile_lock_key("price$usd:<invoice_id>", charge, "kt.charge")
    assert key.render((1,)) == "price$usd:1"


@pytest.mark.parametrize("template", ["inv:<a><b>", "inv:<a>x<b>", "inv:<a>42<b>", "inv:<a>xY7<b>"])
def test_placeholders_must_be_kept_apart_by_a_separator(template: str) -> None:
    """("12", "3") and ("1", "23") would both be "inv:123"."""

    def two(a: str, b: str) -> None: ...

    with pytest.raises(ConfigError, match="separat"):
        compile_lock_key(template, two, "kt.two")


def two(a: object, b: object) -> None: ...


def test_separators_inside_values_cannot_merge_two_arguments() -> None:
    key = compile_lock_key("inv:<a>:<b>", two, "kt.two")
    assert key.render(("1:2", "3")) != key.render(("1", "2:3"))
    assert key.render(("1:2", "3")) == "inv:1%3A2:3"  # readable, and only the separator escaped
    assert key.render((["1", "2"], "3")) != key.render(("1,2", "3")) != key.render(([1, 2], 3)) != ""
    dashed = compile_lock_key("inv:<a>-<b>", two, "kt.two")
    assert dashed.render(("1-2", "3")) != dashed.render(("1", "2-3"))
    assert dashed.render((-1, 2)) != dashed.render(("", "1-2"))


def test_none_containers_and_text_render_apart() -> None:
    assert render_value(None) != render_value("none")
    assert render_value(None) != render_value("None")
    assert render_value([1, 2]) != render_value("1,2")
    assert render_value([1, 2]) != render_value("[1,2]")
    assert render_value({"a": 1}) != render_value("a=1") != render_value(["a=1"])
    assert render_value([""]) != render_value([]) != render_value("")
    assert render_value({"a": "b=c"}) != render_value({"a=b": "c"})
    assert render_value(b"\xff") != render_value("ff")


def test_plain_ids_stay_readable() -> None:
    key = compile_lock_key("invoice:<invoice_id>", charge, "kt.charge")
    assert key.render((42,)) == "invoice:42"
    assert key.render(("INV-2024_0042",)) == "invoice:INV-2024_0042"
    assert key.render(("a1b2c3",), {}) == "invoice:a1b2c3"
    two_ids = compile_lock_key("inv:<a>:<b>", two, "kt.two")
    assert two_ids.render((42, "eu-west")) == "inv:42:eu-west"


class Invoice:
    def __init__(self, id: int, title: str = "March") -> None:
        self.id = id
        self.title = title

    def __str__(self) -> str:  # a label, not an identity: two invoices share a title
        return self.title


def test_objects_without_canonical_text_are_refused_with_a_way_out() -> None:
    def pay(invoice: object) -> None: ...

    key = compile_lock_key("invoice:<invoice>", pay, "kt.pay")
    for value in (Invoice(1), object()):
        with pytest.raises(ConfigError, match=r"<invoice\.id>.*callable"):
            key.render((value,))


def test_an_attribute_path_names_the_resource_of_an_object() -> None:
    def pay(invoice: object, *, by: str = "me") -> None: ...

    key = compile_lock_key("invoice:<invoice.id>:<by>", pay, "kt.pay")
    assert key.render((Invoice(42),)) == "invoice:42:me"
    assert key.render((), {"invoice": Invoice(42), "by": "you"}) == "invoice:42:you"
    assert key.render(({"id": 42},)) == "invoice:42:me"  # a dict, e.g. from JSON
    with pytest.raises(ConfigError, match=r"<invoice\.number>.*Invoice.*'number'"):
        compile_lock_key("invoice:<invoice.number>", pay, "kt.pay").render((Invoice(1),))
    with pytest.raises(ConfigError, match=r"<invoce\.id>"):
        compile_lock_key("invoice:<invoce.id>", pay, "kt.pay")


# The property: two argument tuples share a name only if they name the same resource, by the
# equivalences keys.py documents: a number is its value (42 == 42.0 == Decimal("42.00"), a float
# by its shortest text); a str that spells a number's canonical text, or True/False as
# "true"/"false", is that scalar; a tuple is the list of its items; a dict is its set of pairs.


def same_resource(value: object) -> object:
    """What a value identifies, computed independently of the renderer."""
    if value is None:
        return ("none",)
    if isinstance(value, bool):
        return ("word", "true" if value else "false")
    if isinstance(value, int):
        return ("number", Fraction(value))
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return ("word", repr(value))
        return ("number", Fraction(repr(value)))
    if isinstance(value, Decimal):
        return ("number", Fraction(value)) if value.is_finite() else ("word", str(value))
    if isinstance(value, str):
        if CANONICAL_NUMBER.fullmatch(value) and value != "-0":
            return ("number", Fraction(value))
        return ("word", value)
    if isinstance(value, (list, tuple)):
        return ("list", tuple(same_resource(v) for v in value))
    if isinstance(value, dict):
        return (
            "dict",
            tuple(sorted(((same_resource(k), same_resource(v)) for k, v in value.items()), key=repr)),
        )
    raise AssertionError(f"no oracle for {value!r}")


CANONICAL_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]*[1-9])?")

# A small alphabet, heavy in separators and escapes, so that random values do collide.
tricky_text = st.one_of(
    st.text(alphabet=":,=\\%[]{}-._ a1N", max_size=4),
    st.sampled_from(["none", "None", "%none", "true", "nan", "inf", "", "%empty", "1,2", "[1,2]", "{a=1}"]),
    st.sampled_from(["a=1", "42", "42.0", "-0", "0.10", "0.1", "%3A", "%25", "1:2", "2:3", "%xff"]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 42),
    tricky_text,
    st.decimals(min_value=-50, max_value=50, places=2),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.1, 42.0, -0.0, 1e-7, 1e22, 0.5]),
)
argument = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(tricky_text, st.integers(0, 3)), inner, max_size=3),
    ),
    max_leaves=6,
)
TEMPLATES = ["inv:<a>:<b>", "<a>,<b>", "<a>=<b>", "<a>-<b>", "k[<a>:x<b>]", "<a> <b>!"]


@given(st.lists(st.tuples(argument, argument), min_size=2, max_size=40), st.sampled_from(TEMPLATES))
@settings(max_examples=400, deadline=None)
def test_one_name_means_one_resource(calls: list[tuple[object, object]], template: str) -> None:
    key = compile_lock_key(template, two, "kt.two")
    seen: dict[str, object] = {}
    for args in calls:
        name = key.render(args)
        resource = (same_resource(args[0]), same_resource(args[1]))
        assert seen.setdefault(name, resource) == resource, (template, name, args)
    singles: dict[str, object] = {}
    for value, _ in calls:
        single = render_value(value)
        assert singles.setdefault(single, same_resource(value)) == same_resource(value), (single, value)


def test_the_documented_equivalences_hold() -> None:
    key = compile_lock_key("inv:<a>:<b>", two, "kt.two")
    assert len({key.render((a, "x")) for a in (42, 42.0, Decimal("42.00"), "42")}) == 1
    assert key.render((True, [1, (2, 3)])) == key.render(("true", (1.0, ["2", 3])))
    assert key.render(({"b": 1, "a": 2}, 0)) == key.render(({"a": 2, "b": 1.0}, -0.0))


pieces = st.text(alphabet=":,=-_ %\\[]{}a1", max_size=3)


@given(pieces, pieces, pieces, st.sampled_from(TEMPLATES))
@settings(max_examples=400, deadline=None)
def test_moving_text_across_a_separator_changes_the_name(x: str, y: str, z: str, template: str) -> None:
    """("1:2", "3") against ("1", "2:3"), for every template's own separator."""
    key = compile_lock_key(template, two, "kt.two")
    gap = template.split(">", 1)[1].split("<", 1)[0]
    separator = next(c for c in gap if not c.isalnum())
    assert key.render((x + separator + y, z)) != key.render((x, y + separator + z))
