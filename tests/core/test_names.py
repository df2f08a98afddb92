"""Properties of lock names, checked over generated inputs: one resource has one key, different
resources never share one, and no key grows without bound."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock.celery.keys import compile_lock_key, render_value
from celery_redlock.lock.resource import MAX_NAME_LENGTH, RESERVED_SUFFIXES, lock_key

# Names ending in a reserved suffix (the keys kept beside a lock) are refused, not keyed: that
# rule has tests of its own (tests/core/test_review_fair_admin.py).
names = st.text(min_size=1, max_size=3000).filter(lambda name: not name.endswith(RESERVED_SUFFIXES))


@given(names, names)
@settings(max_examples=300, deadline=None)
def test_distinct_names_get_distinct_keys(a: str, b: str) -> None:
    if a != b:
        assert lock_key("redlock:", a) != lock_key("redlock:", b)
    else:
        assert lock_key("redlock:", a) == lock_key("redlock:", b)


@given(names)
@settings(max_examples=300, deadline=None)
def test_keys_are_bounded_and_short_names_kept(name: str) -> None:
    key = lock_key("redlock:", name)
    assert key.startswith("redlock:")
    assert len(key) <= len("redlock:") + max(MAX_NAME_LENGTH, 64 + len("~sha256:") + 64)
    if len(name) <= MAX_NAME_LENGTH:
        assert key == "redlock:" + name


@given(st.integers(min_value=-(10**15), max_value=10**15))
def test_one_number_renders_one_way_whatever_its_type(n: int) -> None:
    forms = {
        render_value(n),
        render_value(float(n)),
        render_value(Decimal(n)),
        render_value(Decimal(n).quantize(Decimal("0.01"))),
    }
    assert forms == {str(n)}


def invoice(invoice_id: int, amount: int = 0, *, currency: str = "EUR") -> None: ...


@given(st.integers(), st.integers(), st.sampled_from(["EUR", "USD", "JPY"]))
def test_binding_ignores_how_the_call_was_written(invoice_id: int, amount: int, currency: str) -> None:
    key = compile_lock_key("invoice:<invoice_id>:<currency>", invoice, "charge")
    expected = f"invoice:{invoice_id}:{currency}"
    assert key.render((invoice_id, amount), {"currency": currency}) == expected
    assert key.render((), {"invoice_id": invoice_id, "amount": amount, "currency": currency}) == expected
    if currency == "EUR":
        assert key.render((invoice_id,)) == expected
