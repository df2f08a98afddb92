"""The standalone CLI's tests: three real masters on loopback for the module, and the two ways to
run the commands, ``celery-redlock ...`` (``python -m celery_redlock``) and
``celery -A cliapp redlock ...``, each as a subprocess as an operator runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redlock import Redlock
from celery_redlock.testing import ServerSet

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def masters() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def urls(masters: ServerSet) -> str:
    masters.ensure_running()
    return ",".join(masters.urls)


@pytest.fixture
def rl(masters: ServerSet) -> Iterator[Redlock]:
    masters.ensure_running()
    with Redlock(masters.urls, retry_count=0) as instance:
        yield instance


TEST_REQUEST_TIMEOUT = "1.0"


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_REDLOCK_")}
    # Both front ends wait up to a second for a master's answer, unless a test sets its own: at
    # the default 0.1 s a loaded host made a running master "down" in one reading and "free" in
    # the other. The tests of what a timeout reads like set it (or CLIAPP_REQUEST_TIMEOUT).
    env.update(
        {
            "CELERY_REDLOCK_REQUEST_TIMEOUT": TEST_REQUEST_TIMEOUT,
            "CLIAPP_REQUEST_TIMEOUT": TEST_REQUEST_TIMEOUT,
        }
    )
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    return env


def standalone(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``celery-redlock <args>``, with only the CELERY_REDLOCK_* variables given in ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "celery_redlock", *args],
        capture_output=True,
        text=True,
        env=_env(env),
        cwd=HERE,
        input=input if input is not None else "",
        timeout=timeout,
    )


def celery_redlock(urls: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``celery -A cliapp redlock <args>`` over the masters ``urls``."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "cliapp", "redlock", *args],
        capture_output=True,
        text=True,
        env=_env({"CLIAPP_MASTERS": urls}),
        cwd=HERE,
        input="",
        timeout=timeout,
    )
