"""lock_key templates: binding through the signature, canonical values, definition-time errors."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal

import pytest
from celery import Celery

from celery_redlock import ConfigError, RedlockTask
from celery_redlock.keys import compile_lock_key, render_value
from celery_redlock.slots import slot_name


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
    assert render_value(dt.datetime(2024, 1, 1, 13, 0, tzinfo=paris)) == "2024-01-01T12:00:00+00:00"
    assert render_value(True) == "true" and render_value(None) == "none"
    assert render_value({"b": 1, "a": 2}) == "a=2,b=1"
    with pytest.raises(TypeError, match="lock nothing"):
        render_value(object())


def test_callable_key_gets_the_call_arguments() -> None:
    key = compile_lock_key(lambda invoice_id, **kw: f"inv-{invoice_id}", charge, "charge")
    assert key.render((7,), {"amount": 3}) == "inv-7"


def test_bad_placeholder_fails_when_the_task_is_defined() -> None:
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigError, match=r"'keys_test.charge'.*<invoce_id>"):
        @app.task(base=RedlockTask, lock_key="invoice:<invoce_id>", name="keys_test.charge",
                  lazy=False)
        def bad(invoice_id: int) -> None: ...


def test_bound_task_skips_self_and_none_means_the_task_name() -> None:
    app = Celery("keys-test", set_as_current=False)

    @app.task(base=RedlockTask, bind=True, lock_key="acct:<account>", name="kt.bound", lazy=False)
    def bound(self: RedlockTask, account: str) -> None: ...

    @app.task(base=RedlockTask, name="kt.whole", lazy=False)
    def whole(x: int) -> None: ...

    assert bound.lock_name(("a1",)) == "acct:a1"
    assert whole.lock_name((1,)) == "kt.whole"


def test_bad_option_values_name_the_task_and_option() -> None:
    app = Celery("keys-test", set_as_current=False)
    with pytest.raises(ConfigError, match=r"'kt.opt': lock_contended"):
        @app.task(base=RedlockTask, lock_contended="wait", name="kt.opt", lazy=False)
        def opt() -> None: ...


def test_slots_align_to_the_epoch_and_to_cron_fire_times() -> None:
    from celery.schedules import crontab

    # Two sends of one 60 s tick, 18 s apart around the boundary: one slot; the next tick differs.
    base = 1_700_000_040.0  # a multiple of 60
    assert slot_name(60, base - 9) == slot_name(60, base + 9)
    assert slot_name(60, base + 9) != slot_name(60, base + 60)
    every5 = crontab(minute="*/5")
    fire = dt.datetime(2024, 1, 1, 10, 5, tzinfo=dt.timezone.utc).timestamp()
    assert slot_name(every5, fire + 1) == slot_name(every5, fire + 40) == "2024-01-01T10:05:00+00:00"
    assert slot_name(every5, fire - 3) == "2024-01-01T10:05:00+00:00"


def test_binding_agrees_with_inspect_for_every_way_of_calling() -> None:
    import inspect

    from celery_redlock.keys import compile_lock_key

    def charge(invoice_id: int, amount: int = 0, currency: str = "EUR") -> None: ...

    key = compile_lock_key("inv:<invoice_id>:<currency>", charge, "kt.charge")
    signature = inspect.signature(charge)
    for args, kwargs in [((1,), {}), ((1, 5), {}), ((1,), {"currency": "USD"}),
                         ((), {"invoice_id": 1, "amount": 5}), ((1, 2, "GBP"), {}),
                         ((), {"currency": "USD", "invoice_id": 2, "amount": 3})]:
        expected = signature.bind(*args, **kwargs)
        expected.apply_defaults()
        assert key.bind(args, kwargs) == dict(expected.arguments), (args, kwargs)
        # Every parameter given positionally takes a path of its own that binds nothing.
        named = expected.arguments
        assert key.render(args, kwargs) == f"inv:{named['invoice_id']}:{named['currency']}"
    for args, kwargs in [((1, 2, "GBP", 4), {}), ((1,), {"invoice_id": 2}), ((), {"amount": 1}),
                         ((1,), {"invoce_id": 1})]:
        with pytest.raises(ConfigError, match="do not fit its signature"):
            key.render(args, kwargs)
