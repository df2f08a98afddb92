"""Review of 97e25c9: a link the *client* closed for a protocol error is not a lost connection.

``Link.data_received`` closes the link when a server sends what is not RESP (an HTTP server on
the port). The new ``if link.closed`` check in ``open_link`` then raises "the connection was
lost during the handshake": the master is taken for down and retried after each backoff, for
ever, where the blocking transports refuse it at first contact ("refused: not a Redis server",
Master.unfit). Before 97e25c9 the same server read as Silent after the whole request timeout;
neither is the server's own answer, which the new check's comment says it keeps apart.
"""

from __future__ import annotations

import asyncio

import pytest

from celery_redlock import AsyncRedlock, Redlock
from celery_redlock.testing import ServerSet
from tests.core.test_seams_input import Impostor, _http

pytestmark = pytest.mark.timeout(40)


def test_an_http_server_is_refused_by_asyncio_as_by_the_blocking_transport() -> None:
    impostor = Impostor(_http)
    try:
        with ServerSet(2) as servers:
            urls = [*servers.urls, impostor.url]
            with Redlock(urls, retry_count=0, request_timeout=1.0) as rl:
                lock = rl.lock("review30-http", ttl=5)
                assert lock.acquire(blocking=False), lock.last_error
                blocking = lock.last_votes[2].detail
                lock.release()

            async def main() -> list[str]:
                details = []
                async with AsyncRedlock(urls, ttl=5.0, request_timeout=1.0, retry_count=0) as arl:
                    for i in range(3):
                        alock = arl.lock(f"review30-http-{i}")
                        assert await alock.acquire(blocking=False), alock.last_error
                        details.append(alock.last_votes[2].detail)
                        await alock.release()
                        await asyncio.sleep(1.2)  # past the site's backoff: it is tried again
                return details

            details = asyncio.run(main())
        assert blocking.startswith("refused: not a Redis server"), blocking
        # The last attempt at least: by then the asyncio site has had its first contact.
        assert details[-1].startswith("refused: not a Redis server"), details
    finally:
        impostor.close()
