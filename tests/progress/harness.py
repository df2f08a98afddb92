"""The client side of the progress tests: publish canvases and calls with known task ids, say what
each was published after, wait (with deadlines) for every one to end, and hand the checker the
history and the result backend's view."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from celery import chain, chord, group
from celery.canvas import Signature

from celery_redlock.celery.task import is_skipped
from tests.waiting import wait_until as wait_until  # the progress tests import it from here

from . import progressapp
from .checker import Published, Report, Result, check, holder_task_id

POLL = 0.02


class Workload:
    """Everything one test (or one hypothesis example) publishes, on keys ``<tag>.<name>``."""

    def __init__(self, app: Any, queue: str, tag: str | None = None) -> None:
        self.app = app
        self.queue = queue
        self.tag = tag or uuid.uuid4().hex[:12]
        self.published: dict[str, Published] = {}
        self.results: dict[str, Result] = {}

    def key(self, name: object) -> str:
        return f"{self.tag}.{name}"

    # -- publishing -------------------------------------------------------------------------------
    def sig(
        self,
        mode: str,
        name: object,
        seconds: float = 0.0,
        *,
        after: Sequence[str] = (),
        requires: Sequence[str] = (),
    ) -> Signature:
        """An immutable signature of the ``mode`` step on key ``name``, with its own task id."""
        task_id = uuid.uuid4().hex
        key = self.key(name)
        self.published[task_id] = Published(task_id, key, tuple(after), tuple(requires))
        return progressapp.STEPS[mode].si(key, seconds).set(task_id=task_id, queue=self.queue)

    def _sent(self, task_id: str) -> None:
        """Note when the client itself sent ``task_id``."""
        old = self.published[task_id]
        self.published[task_id] = Published(old.task_id, old.key, old.after, old.requires, time.time())

    def chain(self, mode: str, names: Sequence[object], seconds: Sequence[float]) -> list[str]:
        """A chain: each link is published by its predecessor's success, after its completion."""
        sigs: list[Signature] = []
        for name, secs in zip(names, seconds, strict=True):
            before = [sigs[-1].id] if sigs else []
            sigs.append(self.sig(mode, name, secs, after=before, requires=before))
        self._sent(sigs[0].id)
        chain(*sigs).apply_async()
        return [s.id for s in sigs]

    def group(self, mode: str, names: Sequence[object], seconds: Sequence[float]) -> list[str]:
        sigs = [self.sig(mode, n, s) for n, s in zip(names, seconds, strict=True)]
        for s in sigs:
            self._sent(s.id)
        group(sigs).apply_async()
        return [s.id for s in sigs]

    def chord(self, mode: str, names: Sequence[object], seconds: Sequence[float], body: object) -> list[str]:
        """A chord whose body is a locked step too, on key ``body``: published once every header
        member has completed, so none of theirs may refuse it."""
        header = [self.sig(mode, n, s) for n, s in zip(names, seconds, strict=True)]
        ids = [s.id for s in header]
        callback = self.sig(mode, body, 0.0, after=ids, requires=ids)
        for s in header:
            self._sent(s.id)
        chord(header)(callback)
        return [*ids, callback.id]

    def delay(self, mode: str, name: object, seconds: float = 0.0, *, after: Sequence[str] = ()) -> Any:
        sig = self.sig(mode, name, seconds, after=after)
        self._sent(sig.id)
        return sig.apply_async()

    def burst(self, mode: str, names: Sequence[object], seconds: Sequence[float]) -> list[str]:
        return [self.delay(mode, n, s).id for n, s in zip(names, seconds, strict=True)]

    def sequential(
        self, sequences: Sequence[tuple[str, Sequence[tuple[object, float]]]], timeout: float = 60.0
    ) -> None:
        """Sequences of ``delay(key).get()``, each (mode, [(key name, body seconds), ...]), run
        round-robin in this thread: each call is published after the previous ``.get()`` of its
        sequence returned. ``.get()`` is Celery's own."""
        last: dict[int, str] = {}
        for step in range(max((len(calls) for _, calls in sequences), default=0)):
            pending = []
            for index, (mode, calls) in enumerate(sequences):
                if step < len(calls):
                    name, seconds = calls[step]
                    after = [last[index]] if index in last else []
                    pending.append((index, self.delay(mode, name, seconds, after=after)))
            for index, result in pending:
                result.get(timeout=timeout, propagate=False)
                last[index] = result.id

    # -- reading ------------------------------------------------------------------------------------
    def fetch_results(self) -> dict[str, Result]:
        ids = list(self.published)
        backend = self.app.backend
        raws = backend.client.mget([backend.get_key_for_task(i) for i in ids])
        found = {}
        for task_id, raw in zip(ids, raws, strict=True):
            found[task_id] = Result("PENDING") if raw is None else _result(backend.decode_result(raw))
        self.results = found
        return found

    def events(self) -> list[dict[str, Any]]:
        client = progressapp.records()
        return [json.loads(raw) for raw in client.lrange(progressapp.log_name(self.key("x")), 0, -1)]

    def _unended(self) -> list[str]:
        results = self.fetch_results()
        failed = {t for t, r in results.items() if r.state == "FAILURE"}
        unended = []
        for task_id, task in self.published.items():
            if results[task_id].state in ("SUCCESS", "FAILURE"):
                continue
            if any(r in failed for r in task.requires):
                continue  # never published (a chain stopped by a failure; a chord body)
            unended.append(task_id)
        return unended

    def wait(self, timeout: float = 60.0) -> None:
        """Until every published task has ended (or can no longer be published), then until the
        history has what the workers write after the result: ``visible`` and ``released``. A
        deadline passes silently: the checker then names what never ended."""
        deadline = time.monotonic() + timeout
        while self._unended() and time.monotonic() < deadline:
            time.sleep(POLL * 2)
        settle = time.monotonic() + min(10.0, max(1.0, deadline - time.monotonic()))
        while not self._history_complete() and time.monotonic() < settle:
            time.sleep(POLL)

    def _history_complete(self) -> bool:
        events = self.events()
        seen = {(e["event"], e["task_id"]) for e in events}
        for task_id, result in self.results.items():
            if result.state != "SUCCESS" or result.skipped:
                continue
            if not all((kind, task_id) in seen for kind in ("start", "end", "visible", "released")):
                return False
        return True

    def check(self, timeout: float = 60.0) -> Report:
        self.wait(timeout)
        return check(self.published.values(), self.events(), self.results)


def _result(meta: dict[str, Any]) -> Result:
    state, value = str(meta.get("status")), meta.get("result")
    if state == "SUCCESS":
        skipped = is_skipped(value)
        return Result(state, skipped, value.get("holder") if skipped else None)
    if state != "FAILURE":
        return Result(state)
    if isinstance(value, BaseException):
        error, holder = type(value).__name__, str(getattr(value, "holder", "") or "")
    elif isinstance(value, dict):  # an exception the backend did not rebuild
        error = str(value.get("exc_type", ""))
        args = value.get("exc_message") or []
        holder = str(args[6]) if error == "LockNotAcquired" and len(args) > 6 else ""
    else:
        error, holder = type(value).__name__, ""
    return Result(state, False, holder_task_id(holder), error)
