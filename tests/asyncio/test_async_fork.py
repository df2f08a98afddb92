"""An AsyncRedlock in a forked child: the child lets go of its copies of the parent's links
(see aio/link.py), and a call on the parent's AsyncRedlock there is refused, naming the fork."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from celery_redlock.testing import ServerSet

CHILD_USES_PARENTS = textwrap.dedent(
    """
    import asyncio, os, sys
    from celery_redlock import AsyncRedlock, ConfigError

    async def in_child(rl):
        try:
            await rl.lock("async-fork-child", ttl=5).acquire(blocking=False)
        except ConfigError as exc:
            print("refused:", exc, flush=True)
        else:
            return 3
        await rl.aclose()  # the parent's tasks and connections are not the child's to end
        return 0

    async def main():
        rl = AsyncRedlock(sys.argv[1:], retry_count=0)
        lock = rl.lock("async-fork-child", ttl=5)
        assert await lock.acquire(timeout=5), lock.last_error
        await lock.release()
        child = os.fork()
        if child == 0:  # the child has no running loop (asyncio resets it): it runs one of its own
            os._exit(asyncio.run(in_child(rl)))
        _, status = os.waitpid(child, 0)
        # The parent's links are untouched by the child's letting go of its copies.
        again = rl.lock("async-fork-child", ttl=5)
        assert await again.acquire(timeout=5), again.last_error
        await again.release()
        await rl.aclose()
        sys.exit(os.waitstatus_to_exitcode(status))

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
def test_a_forked_child_is_refused_its_parents_async_redlock(masters: ServerSet) -> None:
    # ``masters``: the session's servers brought back running (an earlier test may have
    # stopped or paused some).
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_USES_PARENTS, *masters.urls],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "refused:" in proc.stdout and "forked child" in proc.stdout, proc.stdout


MID_CONNECT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from celery_redlock import AsyncRedlock

    async def main():
        url = sys.argv[1] + "?ssl_cert_reqs=none"
        rl = AsyncRedlock([url], retry_count=0, request_timeout=20, ttl=60)
        asyncio.ensure_future(rl.lock("mid-connect", ttl=60).acquire(blocking=False))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # the test saw the TLS handshake begin
        child = os.fork()
        if child == 0:
            sys.stdin.read()  # holds on until the test closes its stdin
            os._exit(0)
        print(child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


@pytest.mark.timeout(60)
def test_a_connect_under_way_at_the_fork_does_not_outlive_the_parent() -> None:
    """The fork comes while a link's connect is under way: its TLS handshake was begun and is
    never answered (a slow master), so asyncio has made no transport for it yet. Once the
    parent is gone, the connection must close: the child lets go of that socket too."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    port = listener.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", MID_CONNECT, f"rediss://127.0.0.1:{port}/0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        conn, _ = listener.accept()
        conn.settimeout(10)
        assert conn.recv(1)  # the TLS ClientHello: the connect is under way, not finished
        proc.stdin.write("fork\n")
        proc.stdin.flush()
        child = int(proc.stdout.readline())
        assert proc.wait(10) == -signal.SIGKILL
        # The parent is gone: the connection closes, unless the child kept its socket.
        conn.settimeout(5)
        rest = b""
        try:
            while chunk := conn.recv(65536):
                rest += chunk
        except TimeoutError:
            pytest.fail(f"the connection stayed open with the parent gone (child {child} alive)")
        conn.close()
    finally:
        proc.stdin.close()  # the child exits
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        listener.close()
