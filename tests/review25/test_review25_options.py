"""Issue 25 item 4 attacked: a misspelt ``lock_*`` option, or a bad value, must be refused (at
definition, or at the latest by the worker's start-up checks), never silently ignored. These
are Celery's own paths (``@app.task`` keywords, ``task_annotations``, attributes set on a task
after definition), run through a real ``Celery`` app and ``check_app``, which ``worker_init``
runs before a worker goes ready."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_redlock import RedlockTask
from celery_redlock.celery.task import check_app
from celery_redlock.errors import ConfigError
from celery_redlock.testing import ServerSet


def _app(name: str, masters: ServerSet | None = None, **conf: Any) -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.redlock_masters = masters.urls if masters is not None else ["redis://127.0.0.1:1"]
    app.conf.update(conf)
    return app


@pytest.mark.timeout(30)
def test_a_misspelt_option_whose_value_is_callable_is_refused_at_definition() -> None:
    """``lock_key`` takes a callable, so ``lock_kye=key_of`` is the same typo as
    ``lock_kye="invoice:<invoice_id>"``; ``refuse_unknown`` skips every callable value, and the
    task silently locks as a whole (``lock_key=None``): one lock for every invoice."""
    app = _app("r25a")

    def key_of(invoice_id: int) -> str:
        return f"invoice:{invoice_id}"

    with pytest.raises(ConfigError, match="lock_kye"):

        @app.task(shared=False, base=RedlockTask, name="r25a.charge", lock_kye=key_of)
        def charge(invoice_id: int) -> int:
            return invoice_id

        app.finalize()  # Celery makes a task's class when its app is finalized


@pytest.mark.timeout(30)
def test_a_misspelt_option_from_task_annotations_is_refused_by_the_start_up_checks() -> None:
    """``task_annotations`` is Celery's documented way to set task attributes from settings;
    Celery sets them on the task class after it is created, so ``refuse_unknown`` never sees
    them. ``lock_tll`` there is ignored: the worker starts, and the task runs with the default
    TTL."""
    app = _app("r25b", task_annotations={"r25b.charge": {"lock_tll": 600}})

    @app.task(shared=False, base=RedlockTask, name="r25b.charge", lock_key="invoice:<invoice_id>")
    def charge(invoice_id: int) -> int:
        return invoice_id

    app.finalize()
    assert app.tasks["r25b.charge"].lock_tll == 600  # Celery applied the annotation
    with pytest.raises(ConfigError, match="lock_tll"):
        check_app(app)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["task_annotations", "set after definition"])
def test_a_bad_option_value_set_after_definition_is_refused_by_the_start_up_checks(how: str) -> None:
    """``lock_contended="skipp"`` (not a policy) set through annotations, or on the task after
    definition, passes the start-up checks; at run time every policy that is not "skip" or
    "wait" fails the contended run, so the typo turns a skip into a failure."""
    conf = (
        {"task_annotations": {"r25c.charge": {"lock_contended": "skipp"}}}
        if how == "task_annotations"
        else {}
    )
    app = _app("r25c", **conf)

    @app.task(shared=False, base=RedlockTask, name="r25c.charge", lock_key="invoice:<invoice_id>")
    def charge(invoice_id: int) -> int:
        return invoice_id

    if how == "set after definition":
        charge.lock_contended = "skipp"
    app.finalize()
    assert app.tasks["r25c.charge"].lock_contended == "skipp"
    with pytest.raises(ConfigError, match="lock_contended"):
        check_app(app)
