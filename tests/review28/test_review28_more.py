"""The front door as an operator meets it, continued: every ``celery redlock`` command refuses a
misspelt setting the worker refuses; the one-shot CLI says neither "queued" twice nor that it goes
on trying after it has exited; an empty ``--masters`` is blamed on the option; and the sdist's
MANIFEST ships no fragment of the test suite.

Real masters on loopback (``ServerSet``), the commands run as subprocesses, as an operator runs
them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redlock import Redlock
from celery_redlock.lock.holder import HolderRecord
from celery_redlock.lock.transport.master import RETRIED, STILL_TRYING
from celery_redlock.ops import exits
from celery_redlock.testing import Proxy, ServerSet
from celery_redlock.testing.servers import free_port
from tests.core.conftest import take

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def masters() -> Iterator[ServerSet]:
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def urls(masters: ServerSet) -> str:
    masters.ensure_running()
    return ",".join(masters.urls)


def _env(extra_path: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_REDLOCK_")}
    paths = [str(extra_path)] if extra_path is not None else []
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, str(ROOT), env.get("PYTHONPATH")]))
    return env


def run(*argv: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        capture_output=True,
        text=True,
        env=env if env is not None else _env(),
        cwd=cwd,
        input="",
        timeout=60,
    )


def _app(folder: Path, urls: str, typo: bool) -> None:
    lines = [
        "from celery import Celery",
        'app = Celery("typoapp")',
        f"app.conf.redlock_masters = {urls.split(',')!r}",
    ]
    if typo:
        lines.append("app.conf.redlock_tll = 30  # meant: redlock_ttl")
    (folder / "typoapp.py").write_text("\n".join(lines) + "\n")


@pytest.mark.timeout(150)
def test_every_celery_redlock_command_refuses_a_misspelt_setting(urls: str, tmp_path: Path) -> None:
    """``redlock_tll`` stops every command, as it stops the worker: exit 2, naming the key and the
    setting meant. Without it, the same app's ``ls`` runs (the refusal is the typo's)."""
    _app(tmp_path, urls, typo=False)
    fine = run("celery", "-A", "typoapp", "redlock", "ls", cwd=tmp_path, env=_env(tmp_path))
    assert fine.returncode == exits.OK, fine.stdout + fine.stderr
    _app(tmp_path, urls, typo=True)
    for command in (["ls"], ["show", "r28:x"], ["health"], ["leader"], ["release", "r28:x", "--yes"]):
        ran = run("celery", "-A", "typoapp", "redlock", *command, cwd=tmp_path, env=_env(tmp_path))
        said = ran.stdout + ran.stderr
        assert ran.returncode == exits.USAGE, (command, said)
        assert "'redlock_tll' is not a celery-redlock setting; did you mean 'redlock_ttl'?" in ran.stderr, (
            command,
            said,
        )


@pytest.mark.timeout(60)
def test_a_queued_holder_is_said_queued_once(urls: str) -> None:
    """A marker (a message still in the broker) is refused by ``release``; its line reads
    "holder is queued: task ...", not "holder is queued: queued: task ..."."""
    resource = f"r28:{uuid.uuid4().hex[:8]}"
    marker = HolderRecord(
        task="8c1f0000-0000-4000-8000-000000000028", name="charge_invoice", host="w3", pid=4411,
        since=time.time(), ttl=60.0, queued=True, published=True,
    )  # fmt: skip
    with Redlock(urls.split(","), retry_count=0) as rl:
        lock = rl.lock(resource, ttl=30, holder=marker.to_text())
        assert take(lock)
        try:
            ran = run("celery_redlock", "release", resource, "--masters", urls, "--yes")
        finally:
            lock.release()
    assert ran.returncode == exits.NO, ran.stdout + ran.stderr
    assert "holder is queued: task charge_invoice 8c1f0000" in ran.stdout, ran.stdout
    assert "queued: queued" not in ran.stdout + ran.stderr


@pytest.mark.timeout(60)
def test_the_one_shot_cli_does_not_promise_to_keep_trying(masters: ServerSet) -> None:
    """A master that refuses connections and one whose connect the round stopped waiting for:
    the reasons ``health`` and ``show`` print name what happened, not the retries a long-lived
    process would make after them (this command has exited by then)."""
    masters.ensure_running()
    with Proxy(masters[0].address) as proxy:
        proxy.delay(1.0, "down")  # accepted at once; the handshake's reply comes after 1 s
        urls = ",".join([proxy.url, f"redis://127.0.0.1:{free_port()}", masters.urls[2]])
        outputs = [
            run("celery_redlock", *args, "--masters", urls, "--timeout", "0.3", "--request-timeout", "2")
            for args in (["health"], ["health", "--json"], ["show", "r28:x"], ["show", "r28:x", "--json"])
        ]
    for ran in outputs:
        said = ran.stdout + ran.stderr
        assert RETRIED.strip() not in said and STILL_TRYING.strip() not in said, said
        assert "not connected within" in said, said  # the slow master's reason is still given
    shown = json.loads(outputs[3].stdout)
    assert [m["kind"] for m in shown["masters"]][:2] == ["error", "error"], shown


@pytest.mark.timeout(60)
def test_an_empty_masters_option_is_blamed_on_the_option() -> None:
    """``--masters ''`` (or only commas) names ``'--masters'``, not the environment variable; a
    bad ``$CELERY_REDLOCK_MASTERS`` still names the variable."""
    for value in ("", " , "):
        ran = run("celery_redlock", "ls", "--masters", value)
        assert ran.returncode == 2, ran.stderr
        assert "Invalid value for '--masters': no master URL in" in ran.stderr, ran.stderr
        assert "CELERY_REDLOCK_MASTERS" not in ran.stderr, ran.stderr
    env = {**_env(), "CELERY_REDLOCK_MASTERS": " , "}
    ran = run("celery_redlock", "ls", env=env)
    assert ran.returncode == 2, ran.stderr
    assert "Invalid value for $CELERY_REDLOCK_MASTERS: no master URL in" in ran.stderr, ran.stderr


@pytest.mark.timeout(10)
def test_the_sdist_ships_no_fragment_of_the_test_suite() -> None:
    """setuptools adds tests/test_*.py to an sdist by itself, without the conftest and the
    sub-suites they need: MANIFEST.in prunes tests/ after every graft, and says why."""
    rules = [line.split() for line in (ROOT / "MANIFEST.in").read_text().splitlines()]
    rules = [rule for rule in rules if rule and not rule[0].startswith("#")]
    assert ["prune", "tests"] in rules, rules
    pruned = rules.index(["prune", "tests"])
    assert not any(
        rule[0] in {"graft", "recursive-include"} and "tests" in rule[1:] for rule in rules[pruned:]
    )
