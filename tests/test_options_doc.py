"""Task options are declared once (celery_redlock/celery/options.py), and everything else agrees.

- docs/settings.md carries the table generated from the declaration, verbatim;
- the mixin's attributes are the declared options with their declared defaults;
- every option that falls back to a setting names a setting the package knows, with a field;
- a misspelt ``lock_*`` option is a ConfigError at definition naming the closest option.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery, Task

from celery_redlock import ConfigError, RedlockTask, RedlockTaskMixin
from celery_redlock.celery.options import OPTIONS, markdown_table
from celery_redlock.celery.settings import DEFAULTS, RedlockSettings

ROOT = Path(__file__).resolve().parents[1]


def test_the_settings_reference_carries_the_generated_table() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    assert markdown_table() in text, (
        "docs/settings.md's options table differs from celery_redlock/celery/options.py; paste "
        "the output of celery_redlock.celery.options.markdown_table() over it"
    )


def test_the_mixin_has_exactly_the_declared_options() -> None:
    declared = {o.name: o.default for o in OPTIONS}
    on_mixin = {
        name: getattr(RedlockTaskMixin, name) for name in dir(RedlockTaskMixin) if name.startswith("lock_")
    }
    # Methods that share the prefix are not options.
    values = {name: value for name, value in on_mixin.items() if not callable(value) or name == "lock_key"}
    assert values == declared


def test_each_fallback_names_a_known_setting() -> None:
    fields = set(RedlockSettings.__dataclass_fields__)
    for option in OPTIONS:
        if option.setting is not None:
            assert option.setting in DEFAULTS, option.setting
            assert option.field in fields, option.field


@pytest.mark.parametrize(
    ("keywords", "closest"),
    [
        ({"lock_kye": "x:<n>"}, "lock_key"),
        ({"lock_contented": "skip"}, "lock_contended"),
        ({"lock_max_retry": 3}, "lock_max_retries"),
        ({"lock_tll": 5}, "lock_ttl"),
    ],
)
def test_a_misspelt_option_is_refused_at_definition_naming_the_closest(
    keywords: dict[str, object], closest: str
) -> None:
    app = Celery("misspelt", broker="memory://", set_as_current=False)

    with pytest.raises(ConfigError) as caught:

        @app.task(shared=False, base=RedlockTask, name="misspelt.job", **keywords)
        def job(n: int) -> int:
            return n

        app.finalize()
    message = str(caught.value)
    assert "misspelt.job" in message and next(iter(keywords)) in message and repr(closest) in message


def test_a_misspelt_option_on_a_user_base_class_is_refused_too() -> None:
    class Base(RedlockTaskMixin, Task):  # type: ignore[misc]
        abstract = True
        lock_heartbeat_intervall = 2.0

    app = Celery("misspelt-base", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigError, match="lock_heartbeat_interval"):

        @app.task(shared=False, base=Base, lock_key="x:<n>", name="misspelt.based")
        def based(n: int) -> int:
            return n

        app.finalize()


def test_methods_and_known_options_are_not_taken_for_misspellings() -> None:
    app = Celery("fine", broker="memory://", set_as_current=False)

    class Mine(RedlockTask):
        abstract = True

        def lock_note(self) -> str:  # a method of the user's, sharing the prefix
            return "fine"

    @app.task(shared=False, base=Mine, lock_key="x:<n>", lock_ttl=5, lock_contended="skip", name="fine.job")
    def job(n: int) -> int:
        return n

    app.finalize()
    assert app.tasks["fine.job"].lock_ttl == 5
