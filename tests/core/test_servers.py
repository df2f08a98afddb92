"""The embedded servers' fault controls act on the server process itself, and leave nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from celery_redlock.testing import RedisServer, ServerError
from celery_redlock.testing.servers import faketime_library, process_state


def state_of(pid: int) -> str:
    """The process state letter (R, S, T for stopped, Z, ...) of a process that must exist."""
    state = process_state(pid)
    assert state, f"no process {pid}"
    return state


def gone(pid: int) -> bool:
    return process_state(pid) in ("", "Z")


def test_pause_resume_kill_and_cleanup_act_on_the_server() -> None:
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None
    server.pause()
    assert state_of(pid) == "T"
    server.resume()
    assert state_of(pid) in "RS"
    assert server.client().ping()
    server.kill()
    assert gone(pid) and not server.running
    server.start()
    new_pid = server.pid
    assert new_pid != pid and server.client().ping()
    folder = server.dir
    server.cleanup()
    assert new_pid is not None and gone(new_pid) and not folder.exists()


def test_restart_keeps_or_drops_data_as_asked() -> None:
    with RedisServer(persistent=True) as server:
        server.client().set("kept", "1")
        server.restart(keep_data=True)
        assert server.client().get("kept") == b"1"
        server.restart(keep_data=False)
        assert server.client().get("kept") is None
    with RedisServer() as volatile, pytest.raises(ServerError, match="persistent"):
        volatile.restart(keep_data=True)


def test_a_skewed_clock_runs_fast_and_its_server_is_the_process_we_hold() -> None:
    try:
        faketime_library()
    except ServerError as exc:
        pytest.skip(str(exc))
    server = RedisServer(clock_rate=10.0).start()
    pid = server.pid
    assert pid is not None
    try:
        # The pid is the server (no wrapper process in between), so pause really stops it.
        assert Path(f"/proc/{pid}/comm").read_text().strip() in ("valkey-server", "redis-server")
        client = server.client()
        client.set("fast", "1", px=2000)
        started = time.monotonic()
        while client.exists("fast") and time.monotonic() - started < 5:
            time.sleep(0.01)
        assert time.monotonic() - started < 1.0, "a 2 s key should expire in ~0.2 s at 10x"
        server.pause()
        assert state_of(pid) == "T"
        server.resume()
    finally:
        server.cleanup()
    assert gone(pid)


def test_a_clock_offset_shifts_the_server_clock_and_keeps_relative_expiry() -> None:
    try:
        faketime_library()
    except ServerError as exc:
        pytest.skip(str(exc))
    assert RedisServer(clock_offset=60).faketime_spec() == "+60.000000"
    assert RedisServer(clock_offset=-0.5, clock_rate=2).faketime_spec() == "-0.500000 x2.0"
    assert RedisServer(clock_rate=1.005).faketime_spec() == "+0.000000 x1.005"
    assert RedisServer().faketime_spec() is None
    server = RedisServer(clock_offset=60.0).start()
    try:
        for _ in range(2):  # and again after an empty restart: the offset is the process's own
            client = server.client()
            seconds, micros = client.time()
            assert abs(seconds + micros / 1e6 - time.time() - 60.0) < 1.0
            client.set("k", "1", px=5000)  # PX is relative: the offset does not expire it
            assert 4000 < client.pttl("k") <= 5000
            client.close()
            server.restart(keep_data=False)
    finally:
        server.cleanup()


@pytest.mark.timeout(60)
def test_a_pytest_run_stopped_by_sigterm_stops_its_servers(tmp_path: Path) -> None:
    """The pytest plugin turns SIGTERM (how CI runners stop a job) into an orderly stop, so the
    session's servers are stopped by their pids instead of outliving the run."""
    import signal
    import subprocess
    import sys

    (tmp_path / "test_hold.py").write_text(
        "import os, time\n"
        "def test_hold(redlock_masters):\n"
        "    pids = ' '.join(str(server.pid) for server in redlock_masters)\n"
        "    (__import__('pathlib').Path(os.environ['PIDS_FILE'])).write_text(pids)\n"
        "    time.sleep(50)\n"
    )
    pids_file = tmp_path / "pids"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "celery_redlock.testing.pytest_plugin",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env={**os.environ, "PIDS_FILE": str(pids_file)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not pids_file.exists() or not pids_file.read_text():
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "the inner test never started"
            time.sleep(0.05)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        assert len(pids) == 5
        run.send_signal(signal.SIGTERM)
        output = run.communicate(timeout=30)[0]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 128 + signal.SIGTERM, output
    for pid in pids:
        assert gone(pid), f"server {pid} outlived the run"


def test_a_picked_port_taken_by_another_server_moves_and_a_given_one_is_refused() -> None:
    """Parallel test processes can pick the same free port: the second server must not take the
    first one's answers for its own (it would be talking to another test's server)."""
    with RedisServer() as first:
        second = RedisServer()
        second.port = first.port  # as if it had picked the same port a moment before
        try:
            second.start()
            assert second.port != first.port and second.client().ping()
            assert second.client().info("server")["process_id"] != first.client().info("server")["process_id"]
        finally:
            second.cleanup()
        given = RedisServer(port=first.port)  # an address the caller chose: never moved
        try:
            # Seen either way, whichever comes first: the server exits for want of the port, or
            # another process's server answers the ping on it.
            taken = "port was taken by another process|another process's server answers on it"
            with pytest.raises(ServerError, match=taken):
                given.start()
        finally:
            given.cleanup()
