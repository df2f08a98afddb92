"""Daemon threads of their own for connects and deliveries (never a shared pool)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any


def spawn(function: Any, *args: Any) -> Future[Any] | None:
    """``function(*args)`` begun on a daemon thread of its own (a connect, a delivery task); None
    if none can be started (Python 3.12 refuses them from atexit hooks on: the caller then
    connects inline). Not a shared pool: a connect that hangs (a name lookup has no timeout)
    would hold one of its few threads, enough of them would starve every master of every
    Redlock in the process, and its exit would wait for them. Master.hung bounds them instead."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as exc:  # the caller reads it from the future
            future.set_exception(exc)
        else:
            future.set_result(result)

    try:
        threading.Thread(target=run, name="redlock-connect", daemon=True).start()
    except RuntimeError:
        return None
    return future
