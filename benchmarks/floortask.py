"""The floor as a Celery task base, for the benchmark apps' workers (``bench_celery.py``,
``bench_chain.py``): ``floor.py``'s raw commands around a task body, nothing else.

The lock's name is ``floor:<first argument>``; the SET NX PX goes to every master before the
body, and the compare-and-delete, its replies read, as the body ends (whatever way it ends), as
the library does before Celery stores the result."""

from __future__ import annotations

import os
from typing import Any

from celery import Task
from floor import RELEASE_SOURCE, RawMasters, pack

_state: dict[str, Any] = {"pid": None}


class FloorTask(Task):  # type: ignore[misc]
    """The floor: raw SET NX PX before the body, the raw release as it ends."""

    abstract = True

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        if _state["pid"] != os.getpid():  # connections of this process's own (a pool child)
            urls = os.environ["BENCH_MASTERS"].split(",")
            _state.update(pid=os.getpid(), masters=RawMasters(urls))
        masters = _state["masters"]
        key, token = f"floor:{args[0]}", os.urandom(20).hex()
        granted = masters.call(pack("SET", key, token, "NX", "PX", 30000))
        if sum(reply == b"+OK" for reply in granted) < masters.quorum:
            raise RuntimeError(f"floor: no quorum granted {key}")
        self.request.floor_lock = (key, token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.run(*args, **kwargs)
        finally:
            key, token = self.request.floor_lock
            _state["masters"].call(pack("EVAL", RELEASE_SOURCE, 1, key, token))
