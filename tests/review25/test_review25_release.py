"""Issue 25 item 1 attacked: ``admin.release`` (``celery redlock release``) without ``force`` must
never delete a live holder. Each holder here runs in a process of its own (``holder.py``) and
writes its record as the Celery layer does: this host's name, its pid, its TTL and heartbeat."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from celery_redlock import Redlock
from celery_redlock.lock import admin
from celery_redlock.lock.liveness import pid_runs
from celery_redlock.testing import ServerSet
from tests.onmasters import pttls
from tests.waiting import wait_until

HOLDER = Path(__file__).resolve().parent / "holder.py"
ROOT = HOLDER.parents[2]


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"pid {proc.pid} said nothing within {timeout} s")
    return proc.stdout.readline().strip()


@contextmanager
def holder(command: list[str]) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.timeout(60)
def test_release_never_frees_a_holder_whose_heartbeat_a_long_c_call_delays(
    masters: ServerSet, rl: Redlock
) -> None:
    """A holder with 20 s of TTL and a 0.5 s heartbeat runs one C call of about 5 s (sum over a
    big range, a sort, a regex): the GIL is never let go, so its heartbeat thread cannot extend.
    The watch calls it stale after interval + margin (1 s) and deletes it, although the holder
    is running and its own validity has about 15 s left: a contender takes the lock, and when
    the C call returns the holder's ``owned()`` is True beside the contender's."""
    spec = {"urls": masters.urls, "name": "starved", "ttl": 20.0, "every": 0.5}
    with holder([sys.executable, str(HOLDER), "hold", json.dumps(spec)]) as proc:
        ready = _read_line(proc, 30)
        assert ready.startswith("ready "), ready
        _say(proc, "gil 5")
        assert _read_line(proc, 10) == "busy"
        try:
            released, alive = admin.release(rl, "starved", watch=10)
        except admin.ReleaseRefused:
            return  # refused: what a running holder should get (its C call ends; nothing more)
        taken = rl.lock("starved", ttl=10).acquire(blocking=False)
        said = _read_line(proc, 40).split()
        assert not (taken and said[:2] == ["owned", "True"]), (
            f"release without force called a running holder {alive and alive.state} "
            f"({alive and alive.reason}) and deleted it on {released.deleted} masters; a contender "
            f"took the lock, and the holder, back from its C call, says {' '.join(said)}: two holders"
        )


def extended(masters: ServerSet, key: str, quorum: int) -> None:
    """Wait until a quorum of masters has shown ``key`` extended since now: between two
    extensions its PTTL only runs down, so a PTTL above that master's previous reading is the
    holder's extension. Each reading is compared with the one before it, not with the first:
    the first may have been taken just after an extension, which a later one never tops."""
    last = pttls(masters, key)
    rose: set[int] = set()

    def seen() -> bool:
        nonlocal last
        now = pttls(masters, key)
        rose.update(i for i, (was, is_) in enumerate(zip(last, now, strict=True)) if 0 < was < is_)
        last = now
        return len(rose) >= quorum

    wait_until(seen, 10.0, f"an extension of {key} on {quorum} masters")


def _free_pid() -> int:
    for candidate in range(30000, 20000, -7):
        if not pid_runs(candidate) and not os.path.exists(f"/proc/{candidate}"):
            return candidate
    pytest.skip("no free pid found")


@pytest.mark.timeout(60)
def test_release_never_frees_a_live_holder_in_another_pid_namespace_under_this_host_name(
    masters: ServerSet, rl: Redlock
) -> None:
    """A worker in a container with its own pid namespace but this host's name (``docker run
    --network host`` keeps the host's name; so do pods with ``hostNetwork``) records a pid that
    means nothing here. The operator on the host runs release without force: "its holder's
    process no longer runs on this host", and the live, extending holder's lock is deleted on
    every master at once, without any watch."""
    if not shutil.which("unshare"):
        pytest.skip("unshare not installed")
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode().strip()}")
    pid = _free_pid()
    spec = {"urls": masters.urls, "name": "contained", "ttl": 10.0, "every": 0.5, "pid": pid}
    command = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        sys.executable,
        str(HOLDER),
        "ns",
        json.dumps(spec),
    ]
    with holder(command) as proc:
        ready = _read_line(proc, 30).split()
        assert ready[:1] == ["ready"], ready
        assert int(ready[2]) == pid, f"the holder got pid {ready[2]} in its namespace, not {pid}"
        token = ready[1]
        extended(masters, rl.key_prefix + "contained", rl.quorum)  # a live holder
        try:
            released, alive = admin.release(rl, "contained", watch=10)
        except admin.ReleaseRefused as refused:
            assert "alive" in str(refused)
            return
        _say(proc, "owned")
        said = _read_line(proc, 10)
        raise AssertionError(
            f"release without force deleted token {token[:12]}... on {released.deleted} masters as "
            f"{alive and alive.state} ({alive and alive.reason}), while its holder, alive in "
            f"another pid namespace under this host's name, says {said}"
        )
