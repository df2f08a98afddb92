"""An AsyncRedlock in a forked child: the child lets go of its copies of the parent's links
(see aio/link.py), and a call on the parent's AsyncRedlock there is refused, naming the fork."""

from __future__ import annotations

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
