"""The issue 28 review of the front door: the standalone ``celery-redlock`` as an operator runs it
(a subprocess, three real masters on loopback, a fault proxy), its help as an installed package
shows it, and the docs' claims against the code.

- ``release --json`` without ``--yes`` whose input ends (a cron job) printed no document at all
  (click's "Aborted!"), where ``| jq`` was promised one;
- a master whose connect the round stopped waiting for was reported "not connected within
  request_timeout" when what was waited was the command's shorter ``--timeout``;
- with no master answering, ``ls`` said "no lock held on a quorum matches" and ``show`` "not held
  on a quorum": verdicts nobody gave (the exit status, 3, was right);
- a checked release and a forced one logged the same audit line;
- the help pointed at docs/cli.md, which an installed package does not carry;
- the design notes named tests, helpers and settings that do not exist.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from celery_redlock import Redlock
from celery_redlock.lock.holder import process_identity
from celery_redlock.ops import exits
from celery_redlock.ops.standalone import group
from celery_redlock.testing import Proxy, ServerSet
from celery_redlock.testing.servers import free_port, server_binary
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


def name() -> str:
    return f"r28:{uuid.uuid4().hex[:8]}"


def cli(*args: str, input: str = "") -> subprocess.CompletedProcess[str]:
    """``celery-redlock <args>`` as an operator runs it, with none of their CELERY_REDLOCK_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_REDLOCK_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "celery_redlock", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        input=input,
        timeout=30,
    )


@pytest.mark.timeout(60)
def test_release_json_whose_input_ends_unanswered_still_prints_its_document(urls: str) -> None:
    """A script runs ``release --json`` without ``--yes``: no answer is a no, the lock stays, and
    stdout still carries the one JSON document ``| jq`` was promised."""
    resource = name()
    with Redlock(urls.split(","), retry_count=0) as rl:
        lock = rl.lock(resource, ttl=30, holder="nightly export")
        assert take(lock)
        try:
            ran = cli("release", resource, "--masters", urls, "--json")
            assert ran.returncode == exits.NO, ran.stdout + ran.stderr
            doc = json.loads(ran.stdout)
            assert doc["outcome"] == "declined" and doc["released"] is False, doc
            assert "Aborted" not in ran.stderr
            assert rl.lock(resource, ttl=1).acquire(blocking=False) is False  # still held
        finally:
            lock.release()


@pytest.mark.timeout(60)
def test_a_master_the_round_stopped_waiting_for_is_reported_with_the_seconds_waited(
    masters: ServerSet,
) -> None:
    """Its connect is bounded by --request-timeout (2 s here), the round by --timeout (0.2 s):
    the reason names the 0.2 s actually waited, not request_timeout."""
    masters.ensure_running()
    with Proxy(masters[0].address) as proxy:
        proxy.delay(1.0, "down")  # accepted at once; the handshake's reply comes after 1 s
        urls = ",".join([proxy.url, *masters.urls[1:]])
        ran = cli("show", name(), "--masters", urls, "--timeout", "0.2", "--request-timeout", "2", "--json")
    assert ran.returncode == exits.NO, ran.stdout + ran.stderr  # two answered: not held
    slow = json.loads(ran.stdout)["masters"][0]
    assert slow["kind"] == "error", slow
    assert "request_timeout" not in slow["error"], slow
    waited = re.search(r"not connected within (\d+\.\d+) s", slow["error"])
    assert waited is not None, slow
    assert 0.15 <= float(waited.group(1)) < 1.0, slow


@pytest.mark.timeout(60)
def test_with_no_master_answering_the_text_gives_no_verdict() -> None:
    """Exit 3 says nothing can be told; the lines above it must not say "not held" either."""
    urls = ",".join(f"redis://127.0.0.1:{free_port()}" for _ in range(3))  # nothing listens
    listed = cli("ls", "--masters", urls)
    assert listed.returncode == exits.UNAVAILABLE, listed.stdout + listed.stderr
    assert "no lock held" not in listed.stdout
    assert "only 0 of 3 masters answered" in listed.stdout
    shown = cli("show", name(), "--masters", urls)
    assert shown.returncode == exits.UNAVAILABLE, shown.stdout + shown.stderr
    assert "not held on a quorum" not in shown.stdout
    assert "only 0 answered, quorum 2" in shown.stdout


@pytest.mark.timeout(60)
def test_the_audit_line_tells_a_checked_release_from_a_forced_one(urls: str) -> None:
    """A holder shown dead (its pid gone from this host) is released without --force; a live
    label holder with --force. The JSON's ``by`` and the WARNING on stderr say which."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(dead.pid)
    dead.kill()
    dead.wait(10)
    record = json.dumps(
        {"task": "8c1f0000-0000-4000-8000-000000000028", "name": "charge_invoice",
         "host": socket.gethostname(), "pid": dead.pid, "since": time.time(), "ttl": 60,
         "proc": identity}
    )  # fmt: skip
    checked, forced = name(), name()
    with Redlock(urls.split(","), retry_count=0) as rl:
        assert take(rl.lock(checked, ttl=60, holder=record))
        alive = rl.lock(forced, ttl=60, holder="a cron script")
        assert take(alive)
        try:
            ran = cli("release", checked, "--masters", urls, "--yes", "--json")
            assert ran.returncode == exits.OK, ran.stdout + ran.stderr
            doc = json.loads(ran.stdout)
            assert doc["liveness"]["state"] == "gone" and doc["by"].endswith("(celery-redlock release)")
            ran = cli("release", forced, "--masters", urls, "--yes", "--force", "--json")
            assert ran.returncode == exits.OK, ran.stdout + ran.stderr
            doc = json.loads(ran.stdout)
            assert doc["liveness"] is None and doc["by"].endswith("(celery-redlock release --force)")
            assert "(celery-redlock release --force)" in ran.stderr  # the WARNING line
        finally:
            alive.release()


@pytest.mark.timeout(30)
def test_the_help_points_at_a_page_an_installed_package_can_reach() -> None:
    """The wheel carries no docs/ folder: the help names the documentation site's CLI page,
    which the site has (docs/cli.md), on a line of its own (never split at a hyphen)."""
    documentation = re.search(
        r'^Documentation\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M
    )
    assert documentation is not None
    page = documentation.group(1).rstrip("/") + "/cli/"
    assert (ROOT / "docs" / "cli.md").is_file()
    runner = CliRunner()
    for args in ([], ["ls"], ["show"], ["release"], ["health"], ["leader"]):
        shown = runner.invoke(group(), [*args, "--help"], terminal_width=60)
        assert shown.exit_code == 0, shown.output
        assert "docs/cli.md" not in shown.output, args
        assert page in shown.output.split(), (args, shown.output)


@pytest.mark.timeout(10)
def test_the_embedded_servers_client_is_where_getting_started_says() -> None:
    """getting-started: stop an embedded server with ``"${server%-server}-cli"``, for a machine
    without redis-cli."""
    server = server_binary()
    if not server.endswith("-server"):
        pytest.skip(f"the server binary is {server}")
    client = server[: -len("server")] + "cli"
    assert os.access(client, os.X_OK), client
    assert (
        '"${server%-server}-cli" -p 7001 shutdown nosave'
        in (ROOT / "docs" / "getting-started.md").read_text()
    )


# Names the design notes quote from other projects and from the standard library.
_THEIRS = {
    "RedissonLock", "RedissonFairLock", "LockPubSub", "MultiLock", "RedLock",  # Redisson
    "NextId",  # pottery
    "TIMEOUT_MAX",  # threading
    "tostring", "tonumber",  # Lua
}  # fmt: skip


def _looks_like_ours(word: str, called: bool) -> bool:
    return (
        called
        or word.startswith(("test_", "_redlock_", "lock_", "redlock_", "_"))
        or re.fullmatch(r"[a-z][a-z0-9]*_[a-z0-9_]+", word) is not None  # a function, a field
        or re.fullmatch(r"[A-Z][A-Z0-9]*_[A-Z0-9_]+", word) is not None  # a constant, a script
        or re.fullmatch(r"[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*", word) is not None  # a class
    )


def _code_names(text: str) -> set[str]:
    """The names of our code a page quotes in backticks: tests, the task's hooks, options and
    settings, calls, constants and scripts, classes; each part of a dotted name."""
    names = set()
    for quoted in re.findall(r"`([^`\n]+)`", text):
        found = re.fullmatch(r"([A-Za-z_][A-Za-z_0-9.]*)(\([^()]*\))?", quoted)
        if found is None:
            continue
        parts = found.group(1).split(".")
        for i, word in enumerate(parts):
            if word and _looks_like_ours(word, found.group(2) is not None and i == len(parts) - 1):
                names.add(word)
    return names - _THEIRS


@pytest.mark.timeout(30)
def test_the_design_notes_name_code_that_exists() -> None:
    """Every test, hook, setting, constant, class or call the design notes and the concepts page
    name is in the code (a module's name counts, as tests/core/test_fair.py names test_fair)."""
    sources = [
        path
        for folder in ("celery_redlock", "tests", "benchmarks", "examples")
        for path in (ROOT / folder).rglob("*.py")
        if "review28" not in path.parts
    ]
    corpus = "\n".join([*(path.read_text() for path in sources), *(path.stem for path in sources)])
    pages = [*sorted((ROOT / "docs" / "design").glob("*.md")), ROOT / "docs" / "concepts.md"]
    assert len(pages) >= 3
    missing = {
        page.name: sorted(n for n in _code_names(page.read_text()) if not re.search(rf"\b{n}\b", corpus))
        for page in pages
    }
    assert missing == {page: [] for page in missing}, missing
