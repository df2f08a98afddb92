"""One RunState per run (celery/runstate.py): the only writer of a run's state, never shared with
another run; eager runs over real masters, and a look at the Celery layer's source."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_redlock import RedlockTask
from celery_redlock.celery.runstate import RUN_ATTR, TRACED, RunState, run_of
from celery_redlock.celery.settings import close_app_redlock

CELERY_LAYER = Path(__file__).resolve().parents[2] / "celery_redlock" / "celery"


@pytest.fixture
def run_app(redlock_master_urls: list[str]) -> Iterator[Celery]:
    app = Celery("runstate", set_as_current=False)
    app.conf.redlock_masters = redlock_master_urls
    yield app
    close_app_redlock(app)


@pytest.mark.timeout(30)
def test_each_run_has_a_state_of_its_own_and_a_direct_call_inside_is_no_run(run_app: Celery) -> None:
    seen: list[tuple[RunState | None, bool, bool]] = []

    @run_app.task(bind=True, base=RedlockTask, lock_key="runstate:<n>", name="runstate.job", shared=False)
    def job(self: Any, n: int, inner: bool = False) -> int:
        run = run_of(self.request)
        seen.append((run, bool(run and run.entered), bool(run and run.held and not run.held.finished)))
        if not inner:
            assert job(n, inner=True) == n  # a direct call from the body: not a run of its own
            assert self.redlock.owned()  # and it released nothing
        return n

    assert job.apply((1,)).get() == 1
    assert job.apply((1,)).get() == 1  # the same key again: the first run released it
    (first, first_entered, first_held), (inner, _, inner_held), (second, _, second_held) = seen[:3]
    assert first is not None and second is not None and first is not second
    assert first_entered and first_held and second_held
    assert inner is first and inner_held  # the direct call sees its caller's run, held
    assert first.held is not None and first.held.finished  # the end of the run released it
    # Outside any run, a direct call has no run at all.
    seen.clear()
    assert job(2, inner=True) == 2
    assert seen == [(None, False, False)]


@pytest.mark.timeout(30)
def test_a_request_reused_for_a_later_run_starts_from_a_fresh_state(run_app: Celery) -> None:
    """begin() replaces the state on the request: a request object that outlives its run (the
    task's default request) hands nothing of it to the next (its held lock, entered call)."""

    @run_app.task(base=RedlockTask, lock_key="runstate:reused", name="runstate.reused", shared=False)
    def reused() -> str:
        return "ran"

    request = reused.request  # outside any run: the task's default request, kept between calls
    reused.before_start("t-1", (), {})
    earlier = run_of(request)
    assert earlier is not None and earlier.held is not None
    assert earlier.enter() == (None, TRACED)  # the tracer's call of that run
    reused._redlock_finish("SUCCESS")
    reused.before_start("t-2", (), {})
    later = run_of(request)
    assert later is not None and later is not earlier
    assert not later.entered and later.held is not None and not later.held.finished
    reused._redlock_finish("SUCCESS")
    delattr(request, RUN_ATTR)


def test_only_runstate_writes_per_run_state_on_a_request() -> None:
    """No module of the Celery layer but runstate.py sets an attribute on a request: setattr is
    for class-level caches (``cls``), and nothing assigns ``<request>.x = ...``."""
    found = []
    for path in sorted(CELERY_LAYER.rglob("*.py")):
        if path.name == "runstate.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                target = node.args[0] if node.args else None
                if not (isinstance(target, ast.Name) and target.id == "cls"):
                    found.append(f"{path.name}:{node.lineno}: setattr on {ast.unparse(target or node)}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and "request" in ast.unparse(target.value):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)} = ...")
    assert not found, found
