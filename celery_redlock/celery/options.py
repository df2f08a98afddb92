"""The task options, declared once: name, default, the app setting it falls back to, its check,
and one line of documentation.

Everything else is derived from :data:`OPTIONS`: the defaults of ``RedlockTaskMixin``'s
attributes (:func:`install_defaults`), the checks made when a task class is created
(:func:`check_values`; an unknown ``lock_*`` attribute is refused there, naming the closest
option, by :func:`refuse_unknown`), which ``redlock_*`` setting fills an option left at
``None`` (:func:`resolved`), and the options table of ``docs/settings.md``
(:func:`markdown_table`; ``tests/test_options_doc.py`` fails when the two disagree).

Rules that tie options together (``lock_fenced`` with ``lock_reentrant``, the heartbeat interval
against the TTL, ``lock_enqueue`` with the others) are not a single option's: they live with the
code that resolves them (task.py, enqueue.py).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._validate import choice, count, flag, number
from ..errors import ConfigError
from .settings import CONTENDED_POLICIES, RELEASE_POLICIES, enqueue_mode, wait_timeout_setting

Check = Callable[[str, Any], object]


def _seconds(label: str, value: Any) -> object:
    return number(label, value, above=0, unit="seconds")


def _backoff(label: str, value: Any) -> object:
    return number(label, value, at_least=0, unit="seconds")


def _one_of(values: tuple[str, ...]) -> Check:
    return lambda label, value: choice(label, value, values)


def _enqueue(label: str, value: Any) -> object:
    return enqueue_mode(label, value)


@dataclass(frozen=True)
class TaskOption:
    """One task option. ``setting`` is the ``redlock_*`` setting a ``None`` value falls back to
    (None: the option has a default of its own); ``check`` validates a value that is not None
    when the task class is created (None: checked elsewhere, see the module docstring)."""

    name: str
    default: Any
    setting: str | None
    check: Check | None
    doc: str

    @property
    def field(self) -> str | None:
        """The ``RedlockSettings`` field of ``setting``."""
        return None if self.setting is None else self.setting.removeprefix("redlock_")


OPTIONS: tuple[TaskOption, ...] = (
    TaskOption(
        "lock_key",
        None,
        None,
        None,  # compiled and checked by keys.compile_lock_key
        "The resource: a template whose `<name>` placeholders are bound from the call's arguments "
        '(`"invoice:<invoice_id>"`), a callable of the call\'s arguments, or `None` for one lock for '
        "every call of the task (named `%task:<task name>`, which no template can render).",
    ),
    TaskOption("lock_ttl", None, "redlock_ttl", _seconds, "Lock TTL in seconds for this task."),
    TaskOption(
        "lock_contended",
        None,
        "redlock_contended",
        _one_of(CONTENDED_POLICIES),
        'What a run does when another run holds the lock: `"retry"` later, `"skip"` (a SUCCESS whose '
        'value `is_skipped` recognises), `"fail"` (`LockNotAcquired`) or `"wait"` in the worker, '
        "woken by the release. A run whose masters did not answer is always retried, never skipped "
        "or failed as a duplicate, and fails naming them once `lock_max_retries` is spent.",
    ),
    TaskOption(
        "lock_wait_timeout",
        None,
        "redlock_wait_timeout",
        wait_timeout_setting,
        'How long a `"wait"` run waits for the lock before the retry policy takes over (seconds, '
        "finite, above 0).",
    ),
    TaskOption(
        "lock_reentrant",
        None,
        "redlock_reentrant",
        flag,
        "`True`: a reentrant lock owned by the execution, so code the body calls may take it again "
        "through `celery_redlock.app_redlock(app).lock(name, reentrant=True)`.",
    ),
    TaskOption(
        "lock_fenced",
        None,
        "redlock_fenced",
        flag,
        "`True`: every grant carries a fence, `self.redlock.fence`, above every earlier grant's of "
        "the resource, for the resource to refuse a stale write (`celery_redlock.fenced`).",
    ),
    TaskOption(
        "lock_retry_backoff",
        None,
        "redlock_retry_backoff",
        _backoff,
        "Lock retries wait a full-jitter countdown, uniform in "
        "`[0, min(backoff_max, backoff x 2**attempt)]` seconds.",
    ),
    TaskOption(
        "lock_retry_backoff_max",
        None,
        "redlock_retry_backoff_max",
        _backoff,
        "Upper bound of that countdown (seconds).",
    ),
    TaskOption(
        "lock_max_retries",
        None,
        "redlock_max_retries",
        count,
        "Lock retries before the run fails with `LockNotAcquired` (`None`: unbounded); counted apart "
        "from the task's own `max_retries`.",
    ),
    TaskOption(
        "lock_heartbeat",
        True,
        None,
        flag,
        "Extend the lock while the body runs. `False`: the lock lasts its TTL (the worker warns).",
    ),
    TaskOption(
        "lock_heartbeat_interval",
        None,
        "redlock_heartbeat_interval",
        _seconds,
        "Seconds between extensions (`None`: TTL/3). At most TTL - drift - 2 x request timeout, so "
        "an extension lands before validity ends with one round missed.",
    ),
    TaskOption(
        "lock_max_hold",
        None,
        None,
        _seconds,
        "Stop extending after this many seconds (the body is told: `ensure()` raises). `None`: the "
        "run's own hard time limit on the prefork pool, which ends the run there; no cap elsewhere.",
    ),
    TaskOption(
        "lock_release",
        "on_return",
        None,
        _one_of(RELEASE_POLICIES),
        '`"on_return"`: released as the body ends, before the result is stored. `"on_expiry"`: after '
        "a successful run the lock is left to expire, so a duplicate within the TTL is refused.",
    ),
    TaskOption(
        "lock_slot",
        None,
        None,
        None,  # a schedule: checked by slots.slot_time in task.py
        "Append the schedule slot to the lock name, so every copy of one periodic tick contends for "
        "one key; `True` takes the schedule from the task's `beat_schedule` entry.",
    ),
    TaskOption(
        "lock_enqueue",
        None,
        "redlock_enqueue",
        _enqueue,
        'Deduplicate at publish: `"return_existing"` (a call whose key is queued or running for the '
        'same task returns that task\'s `AsyncResult`) or `"raise"` (`AlreadyQueued`); `False`: off '
        "whatever the app setting.",
    ),
    TaskOption(
        "lock_enqueue_ttl",
        None,
        "redlock_enqueue_ttl",
        _seconds,
        "Seconds the queued marker lasts once the broker took the message.",
    ),
)

BY_NAME: Mapping[str, TaskOption] = {option.name: option for option in OPTIONS}


def install_defaults(cls: type) -> None:
    """Set each option's default as a class attribute of ``cls`` (the mixin)."""
    for option in OPTIONS:
        setattr(cls, option.name, option.default)


def refuse_unknown(attributes: Iterable[tuple[str, Any]], task_name: str, owner: str = "") -> None:
    """A :class:`ConfigError` for an attribute that looks like an option but is none: a misspelt
    option is otherwise silently ignored, and its default (a constant key, no TTL) left in force.

    A method the class defines itself (``owner`` is its ``__qualname__``) or a descriptor is no
    option; any other value is, a callable included (``lock_key`` takes one, so ``lock_kye=f``
    is the same typo as ``lock_kye="x:<n>"``)."""
    for name, value in attributes:
        if not name.startswith("lock_") or name in BY_NAME:
            continue
        if isinstance(value, (property, staticmethod, classmethod)):
            continue
        if owner and inspect.isfunction(value) and value.__qualname__.startswith(owner + "."):
            continue
        close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {', '.join(BY_NAME)}"
        raise ConfigError(f"task {task_name!r}: {name!r} is not a task option{hint}")


def check_values(task: Any, task_name: str) -> None:
    """Check each option set on ``task`` (a task class or instance; not None) with its own check."""
    for option in OPTIONS:
        value = getattr(task, option.name)
        if value is not None and option.check is not None:
            option.check(f"task {task_name!r}: {option.name}", value)


def resolved(task: Any, name: str, settings: Any) -> Any:
    """Option ``name`` of ``task``, or, left at None, the app setting it falls back to."""
    value = getattr(task, name)
    option = BY_NAME[name]
    if value is None and option.field is not None:
        return getattr(settings, option.field)
    return value


def markdown_table() -> str:
    """The options table of ``docs/settings.md``, as it must read."""
    lines = ["| Option | Default | Meaning |", "|---|---|---|"]
    for option in OPTIONS:
        default = f"`{option.setting}`" if option.setting else f"`{option.default!r}`"
        if option.default is not None and not isinstance(option.default, bool):
            default = f'`"{option.default}"`' if isinstance(option.default, str) else default
        lines.append(f"| `{option.name}` | {default} | {option.doc} |")
    return "\n".join(lines)
