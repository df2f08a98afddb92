"""In-process runs (``apply()``): a user base class whose ``__call__`` wraps every run, listed
before the mixin (``class Mine(MyBase, RedlockTaskMixin)``): a run the lock skips must not run
its body, whichever order the bases are given in; Python gives no error for either order."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Task

from celery_redlock import ConfigError, Redlock, RedlockTask, RedlockTaskMixin


class Wrapping(Task):  # type: ignore[misc]
    """A base that wraps every run (a transaction, a log context, a metric), as many codebases
    have; it calls the body itself."""

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def test_a_task_class_listing_a_celery_task_base_before_the_mixin_is_refused() -> None:
    """``class X(Wrapping, RedlockTaskMixin)`` with ``Wrapping(Task)``: Celery's Task comes ahead of
    the mixin in the MRO and shadows every hook of the lock (before_start, __call__): the body
    ran with no lock at all, skipped or not. Refused at definition, saying the right order."""
    with pytest.raises(ConfigError, match="RedlockTaskMixin must come before"):

        class WrappedFirst(Wrapping, RedlockTaskMixin):  # type: ignore[misc]
            abstract = True


def test_a_wrapping_mixin_ahead_of_the_lock_is_guarded() -> None:
    """A plain (non-Task) mixin with a ``__call__`` listed first is fine: its ``__call__`` is
    guarded, so a skipped run returns its marker before the wrapper can call ``run``."""

    class Wraps:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.run(*args, **kwargs)  # type: ignore[attr-defined]

    class Guarded(Wraps, RedlockTask):  # type: ignore[misc]
        abstract = True

    assert getattr(Guarded.__call__, "_redlock_guarded", False)


@pytest.mark.timeout(60)
def test_a_contended_eager_run_in_wait_mode_gives_up_within_one_lock_ttl(review_app: Any, tag: str) -> None:
    """docs/settings.md and the README: a contended eager run retries in-process "one lock TTL
    at most when unbounded". In ``wait`` mode it first waits ``lock_wait_timeout`` as a worker
    would, and only then starts the TTL-long retries: here 4 s + 2 s for a 2 s TTL."""
    import time

    app = review_app.app

    @app.task(
        name=f"review.eager_wait_{tag}",
        base=review_app.RedlockTask,
        lock_key="e:<key>",
        lock_contended="wait",
        lock_ttl=2.0,
        lock_wait_timeout=4.0,
    )
    def waiter(key: str) -> str:
        return key

    masters = app.conf.redlock_masters
    with Redlock(masters.split(",") if isinstance(masters, str) else masters) as rl:
        other = rl.lock(f"e:{tag}", ttl=30)
        assert other.acquire(blocking=False), other.last_error
        try:
            started = time.monotonic()
            result = waiter.apply((tag,))
            took = time.monotonic() - started
        finally:
            other.release()
    assert result.failed(), result.result
    assert took <= 2.0 + 0.5, f"the eager run gave up after {took:.1f} s, past its 2 s lock TTL"
