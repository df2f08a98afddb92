"""``celery-redlock ls|show|release|health|leader`` on real masters, with no Celery app: the
masters from --masters or CELERY_REDLOCK_MASTERS, the --json documents, the exit statuses (0 ok,
1 the answer is no, 2 usage, 3 no quorum answered), and the release rules: a live holder is never
released without --force, nor a queued message's marker."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis

from celery_redlock import Redlock
from celery_redlock.lock.heartbeat import Heartbeat
from celery_redlock.lock.holder import HolderRecord, process_identity
from celery_redlock.testing import ServerSet
from celery_redlock.testing.servers import free_port

from ..core.conftest import take, take_everywhere
from .conftest import standalone


def name() -> str:
    return f"cli:{uuid.uuid4().hex[:8]}"


def record(ttl: float, **fields: object) -> str:
    return json.dumps(
        {"task": "8c1f0000-0000-4000-8000-000000000001", "name": "charge_invoice", "host": "worker-3",
         "pid": 4242, "since": time.time(), "ttl": ttl, **fields}
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_show_and_ls_as_text_and_json_with_their_exit_statuses(urls: str, rl: Redlock) -> None:
    resource = name()
    lock = rl.lock(resource, ttl=30, holder=record(30))
    take_everywhere(lock)  # "3 of 3 masters", one token everywhere
    try:
        shown = standalone("show", resource, "--masters", urls)
        assert shown.returncode == 0, shown.stderr
        assert "held on a quorum (3 of 3 masters, quorum 2)" in shown.stdout
        assert "*" not in shown.stdout  # one token everywhere: nothing to tell apart
        doc = json.loads(standalone("show", resource, "--masters", urls, "--json").stdout)
        assert doc["held"] and doc["token"] == lock.token and doc["answered"] == 3 and doc["quorum"] == 2
        assert doc["holder"]["name"] == "charge_invoice" and len(doc["masters"]) == 3

        listed = standalone("ls", f"{resource}*", "--masters", urls, "--json")
        assert listed.returncode == 0, listed.stderr
        listing = json.loads(listed.stdout)
        assert [view["name"] for view in listing["locks"]] == [resource]
        assert listing["complete"] and listing["stopped_at"] is None and listing["errors"] == {}
        assert (listing["answered"], listing["masters"], listing["quorum"]) == (3, 3, 2)
        table = standalone("ls", f"{resource}*", "--masters", urls)
        assert table.stdout.splitlines()[0].split() == ["RESOURCE", "HOLDER", "AGE", "TTL", "LEFT", "MASTERS"]
        assert resource in table.stdout and "task charge_invoice" in table.stdout
    finally:
        lock.release()
    free = standalone("show", resource, "--masters", urls, "--json")
    assert free.returncode == 1 and json.loads(free.stdout)["held"] is False


@pytest.mark.timeout(60)
def test_show_marks_the_locks_token_only_when_masters_disagree_and_explains_the_mark(
    masters: ServerSet, urls: str, rl: Redlock
) -> None:
    resource = name()
    lock = rl.lock(resource, ttl=30)
    take_everywhere(lock)  # still held on the two others once master 0's key is overwritten
    client = masters[0].client()
    try:
        client.set(f"redlock:{resource}", "f" * 40 + "|a leftover", px=30000)
        shown = standalone("show", resource, "--masters", urls)
        assert shown.returncode == 0, shown.stderr  # still held on 2 of 3
        assert f"*{lock.token[:40]}" in shown.stdout and f" {'f' * 40}" in shown.stdout
        assert "* marks the lock's token" in shown.stdout
    finally:
        client.delete(f"redlock:{resource}")
        client.close()
        lock.release()


@pytest.mark.timeout(60)
def test_ls_says_plainly_that_it_stopped_at_the_limit(urls: str, rl: Redlock) -> None:
    prefix = name()
    locks = [rl.lock(f"{prefix}-{i}", ttl=30) for i in range(4)]
    assert all(take(lock) for lock in locks)
    try:
        listed = standalone("ls", f"{prefix}-*", "--limit", "2", "--masters", urls)
        assert listed.returncode == 1, listed.stdout + listed.stderr
        assert "stopped after --limit 2 keys; more keys match" in listed.stderr
        doc = json.loads(standalone("ls", f"{prefix}-*", "--limit", "2", "--masters", urls, "--json").stdout)
        assert doc["complete"] is False and doc["stopped_at"] == "limit" and len(doc["locks"]) == 2
    finally:
        for lock in locks:
            lock.release()


@pytest.mark.timeout(60)
def test_the_environment_names_the_masters_and_the_option_wins(urls: str, rl: Redlock) -> None:
    resource = name()
    lock = rl.lock(resource, ttl=30)
    assert take(lock)
    try:
        from_env = standalone("show", resource, env={"CELERY_REDLOCK_MASTERS": urls})
        assert from_env.returncode == 0, from_env.stderr
        # A broken variable does not matter when the option is given.
        both = standalone("show", resource, "--masters", urls, env={"CELERY_REDLOCK_MASTERS": "nonsense"})
        assert both.returncode == 0, both.stderr
        prefixed = standalone(
            "show",
            resource,
            "--json",
            env={"CELERY_REDLOCK_MASTERS": urls, "CELERY_REDLOCK_KEY_PREFIX": "x:"},
        )
        assert prefixed.returncode == 1 and json.loads(prefixed.stdout)["key"] == f"x:{resource}"
    finally:
        lock.release()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--masters", "http://127.0.0.1:6379"], {}, "Invalid value for '--masters': masters: 'http://"),
        (["--masters", "127.0.0.1:6379"], {}, "is not a redis URL"),
        (["--masters", "redis://h:port"], {}, "Invalid value for '--masters'"),
        (["--masters", " , "], {}, "no master URL in"),
        ([], {"CELERY_REDLOCK_MASTERS": "nonsense"}, "Invalid value for $CELERY_REDLOCK_MASTERS"),
        ([], {}, "no masters: give --masters URL,URL,... or set $CELERY_REDLOCK_MASTERS"),
        (["--masters", "redis://127.0.0.1:9", "--timeout", "0"], {}, "Invalid value for '--timeout'"),
        (["--masters", "redis://127.0.0.1:9", "--timeout", "-1"], {}, "Invalid value for '--timeout'"),
        (["--masters", "redis://127.0.0.1:9", "--request-timeout", "0"], {}, "'--request-timeout'"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_option(
    args: list[str], env: dict[str, str], says: str
) -> None:
    ran = standalone("health", *args, env=env)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert says in ran.stderr and ran.stdout == ""


@pytest.mark.timeout(60)
def test_fewer_than_a_quorum_answering_is_exit_status_3_for_every_command(urls: str) -> None:
    # One live master and two loopback ports nobody listens on.
    dead = ",".join(f"redis://127.0.0.1:{free_port()}" for _ in range(2))
    masters = f"{urls.split(',')[0]},{dead}"
    for args in (["ls"], ["show", "x"], ["release", "x", "--yes"], ["health"], ["leader"]):
        ran = standalone(*args, "--masters", masters, "--timeout", "0.3", "--json")
        assert ran.returncode == 3, (args, ran.stdout, ran.stderr)
        doc = json.loads(ran.stdout)  # still one JSON document
        assert doc.get("answered", doc.get("sound")) == 1, (args, doc)
    shown = standalone("show", "x", "--masters", masters, "--timeout", "0.3")
    assert "only 1 of 3 masters answered (quorum 2): whether it is held cannot be told" in shown.stderr


@pytest.mark.timeout(60)
def test_health_json_and_the_down_reason_says_what_was_waited(urls: str) -> None:
    ok = standalone("health", "--masters", urls, "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["status"] == "ok" and doc["sound"] == 3 and doc["timeout"] == 1.0
    assert {m["master"] for m in doc["masters"]} == {
        u.removeprefix("redis://").split("/")[0] for u in urls.split(",")
    }
    # A loopback listener that accepts connections and never answers: a paused master.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        # The request timeout is the subject: 0.3 s, short of the health check's 0.5 s round.
        ran = standalone(
            "health",
            "--masters",
            f"{urls},redis://127.0.0.1:{port}",
            "--timeout",
            "0.5",
            env={"CELERY_REDLOCK_REQUEST_TIMEOUT": "0.3"},
        )
    assert ran.returncode == 1, ran.stdout + ran.stderr  # degraded: 3 of 4 sound, quorum 3
    (reason,) = [line for line in ran.stdout.splitlines() if line.startswith(f"127.0.0.1:{port}: error")]
    assert re.search(
        r"did not answer within 0\.\d\d s \(a connect's bound: request_timeout, 0\.3 s", reason
    ), reason


@pytest.mark.timeout(60)
def test_release_never_breaks_a_live_holder(urls: str, rl: Redlock) -> None:
    resource = name()
    heartbeat = Heartbeat("test-cli-heartbeat")
    lock = rl.lock(resource, ttl=1.5, holder=record(1.5, host=socket.gethostname(), pid=1, heartbeat=0.5))
    assert take(lock)
    heartbeat.keep(lock)  # extended every 0.5 s
    try:
        refused = standalone("release", resource, "--masters", urls, "--yes", "--watch", "5")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert "holder is alive" in refused.stdout and "refused: its holder is alive" in refused.stderr
        doc = json.loads(
            standalone("release", resource, "--masters", urls, "--yes", "--watch", "5", "--json").stdout
        )
        assert doc["outcome"] == "refused" and not doc["released"] and doc["liveness"]["state"] == "alive"
        assert lock.owned() and rl.lock(resource, ttl=1).acquire(blocking=False) is False
    finally:
        heartbeat.forget(lock)
        heartbeat.stop()
        lock.release()


@pytest.mark.timeout(60)
def test_a_dead_holder_is_released_and_the_next_acquire_gets_in(urls: str, rl: Redlock) -> None:
    resource = name()
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    identity = process_identity(dead.pid)
    dead.kill()
    dead.wait(10)
    holder = record(60, host=socket.gethostname(), pid=dead.pid, proc=identity)
    assert take(rl.lock(resource, ttl=60, holder=holder))
    # What the masters hold, read off each server: on a loaded host the acquire may have
    # retracted a master whose reply came late, and the release deletes what is there.
    key = rl.key_prefix + resource
    holding = sum(bool(redis.Redis.from_url(u, socket_timeout=2).exists(key)) for u in urls.split(","))
    ran = standalone("release", resource, "--masters", urls, "--yes", "--json")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    doc = json.loads(ran.stdout)
    assert holding >= 2 and doc["deleted"] == holding, (holding, doc)
    assert doc["outcome"] == "released" and doc["liveness"]["state"] == "gone"
    assert "(celery-redlock release)" in doc["by"]
    assert "WARNING celery_redlock.admin: force-released" in ran.stderr  # the audit line
    again = rl.lock(resource, ttl=5)
    assert take(again)
    again.release()


@pytest.mark.timeout(60)
def test_a_queued_marker_is_shown_as_such_and_refused_without_force(urls: str, rl: Redlock) -> None:
    resource = name()
    marker = HolderRecord(
        task="5e1d0000-0000-4000-8000-00000000beef", name="billing.refund", host="web-1", pid=812,
        since=time.time(), ttl=60, queued=True, published=True,
    ).to_text()  # fmt: skip
    assert take(rl.lock(resource, ttl=60, holder=marker))
    listed = standalone("ls", resource, "--masters", urls)
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(resource)]
    assert "queued: task billing.refund 5e1d" in row
    refused = standalone("release", resource, "--masters", urls, "--yes")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "holder is queued" in refused.stdout and "5e1d0000" in refused.stdout
    assert "refused: its holder is queued; --force releases anyway" in refused.stderr
    # Refused at once, without asking: there is nothing to confirm.
    asked = standalone("release", resource, "--masters", urls)
    assert asked.returncode == 1 and "[y/N]" not in asked.stdout
    assert json.loads(standalone("show", resource, "--masters", urls, "--json").stdout)["marker"]
    forced = standalone("release", resource, "--masters", urls, "--yes", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "released redlock:" in forced.stdout
    assert standalone("show", resource, "--masters", urls).returncode == 1


@pytest.mark.timeout(60)
def test_force_warns_first_as_part_of_the_prompt_and_a_no_releases_nothing(urls: str, rl: Redlock) -> None:
    resource = name()
    lock = rl.lock(resource, ttl=30, holder="a cron script")
    assert take(lock)
    declined = standalone("release", resource, "--masters", urls, "--force", input="n\n")
    assert declined.returncode == 1 and "not released: not confirmed" in declined.stderr
    assert lock.owned() and lock.extend()
    forced = standalone("release", resource, "--masters", urls, "--force", input="y\n")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    out = forced.stdout
    assert (
        out.index("WARNING: --force releases it") < out.index("now? [y/N]") < out.index("released redlock:")
    )
    # The prompt's line is ended before anything else is written.
    assert "[y/N]: \n" in out or out.split("[y/N]:")[1].startswith(" \n")
    assert "force-released" in forced.stderr and "held by 'a cron script'" in forced.stderr
    assert not lock.extend()


@pytest.mark.timeout(60)
def test_leader_reads_the_record_a_quorum_agrees_on(masters: ServerSet, urls: str) -> None:
    lock_name = f"beat:{uuid.uuid4().hex[:8]}"
    value = json.dumps({"hostname": "beat-1", "pid": 77, "since": time.time(), "lock": "x", "ttl": 10})
    clients = [server.client() for server in masters]
    try:
        for client in clients[:2]:
            client.set(f"redlock:{lock_name}:leader", value, px=30000)
        shown = standalone("leader", "--lock-name", lock_name, "--masters", urls)
        assert shown.returncode == 0, shown.stderr
        assert f"beat leader for redlock:{lock_name}: beat-1 pid 77" in shown.stdout
        doc = json.loads(standalone("leader", "--lock-name", lock_name, "--masters", urls, "--json").stdout)
        assert doc["leader"]["pid"] == 77 and doc["lock"] == f"redlock:{lock_name}" and doc["answered"] == 3
        clients[0].delete(f"redlock:{lock_name}:leader")  # one of three: no quorum names it
        none = standalone("leader", "--lock-name", lock_name, "--masters", urls, "--json")
        assert none.returncode == 1 and json.loads(none.stdout)["leader"] is None
    finally:
        for client in clients:
            client.delete(f"redlock:{lock_name}:leader")
            client.close()
