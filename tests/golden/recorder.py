"""A recording TCP proxy for the golden wire tests: what a client sends to each master, per link.

The fault proxy (:mod:`celery_redlock.testing.proxy`) reshapes traffic; this one only watches it.
One listening port per master, every connection forwarded both ways on one selector thread, and
every byte a client sends upstream kept for its connection. A test calls :meth:`Recorder.mark`
before an operation and :meth:`Recorder.recorded` after it to get exactly that operation's bytes.

A release sent without waiting returns before the proxy has read it, so both calls first make
sure that everything clients sent has been read (:meth:`Recorder.sync`).
"""

from __future__ import annotations

import collections
import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

CHUNK = 65536
IO_TIMEOUT = 5.0  # a connect or a send that takes longer means the master is gone: drop the link
QUIET = 0.05
# Other test processes on this machine pick "free" ports on 127.0.0.1 and may connect to one that
# is ours by then (a probe of a port they think is closed): their bytes would land in a record.
# Linux answers on all of 127/8; elsewhere the listeners fall back to 127.0.0.1.
HOST = "127.0.0.57"


@dataclass(eq=False)
class _Link:
    """One client connection, its connection to the master, and what the client sent."""

    number: int  # 1 for a master's first connection, in the order accepted
    client: socket.socket
    upstream: socket.socket
    sent: bytearray = field(default_factory=bytearray)
    mark: int = 0  # how much of ``sent`` came before the latest mark


class Recorder:
    """A recording proxy per master in ``targets`` ((host, port) each), on loopback ports."""

    def __init__(self, targets: Sequence[tuple[str, int]]) -> None:
        self.targets = list(targets)
        self._selector = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        for index in range(len(self.targets)):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind((HOST, 0))
            except OSError:
                listener.bind(("127.0.0.1", 0))
            listener.listen(16)
            listener.setblocking(False)
            self._listeners.append(listener)
            self._selector.register(listener, selectors.EVENT_READ, index)
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._links: list[list[_Link]] = [[] for _ in self.targets]
        self._mutex = threading.Lock()  # guards _links, every link's sent and mark, _last
        self._last = time.monotonic()  # when upstream bytes last arrived
        self._stopping = False
        self._syncs: collections.deque[threading.Event] = collections.deque()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="golden-recorder", daemon=True)
        # Where clients connect, one (host, port) per master, in the order of ``targets``.
        self.addresses = [(str(a[0]), int(a[1])) for a in (sock.getsockname() for sock in self._listeners)]
        self.urls = [f"redis://{host}:{port}/0" for host, port in self.addresses]

    def start(self) -> Recorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and close every socket; bounded by ``IO_TIMEOUT``."""
        self._stopping = True
        if self._thread.ident is None:
            self._shut()  # never started: nothing else will close the sockets
        else:
            self._wake()
            self._thread.join(IO_TIMEOUT)
            if self._thread.is_alive():
                raise RuntimeError("the recorder thread did not stop")
        self._wake_w.close()
        if self._failure is not None:
            raise RuntimeError("the recorder thread failed") from self._failure

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what was recorded --------------------------------------------------------------------------
    def sync(self, quiet: float = QUIET) -> None:
        """Return once what clients sent before this call is recorded.

        On loopback a ``send`` returns once its bytes are queued on the receiving socket, so the
        thread only has to read until no socket is readable. A quiet spell after that covers a
        kernel that queues them later (only under load: it would show as a missing command).
        """
        if not self._thread.is_alive():
            raise RuntimeError("the recorder thread is not running") from self._failure
        started = time.monotonic()
        done = threading.Event()
        self._syncs.append(done)
        self._wake()
        if not done.wait(IO_TIMEOUT):
            raise RuntimeError("the recorder thread did not answer") from self._failure
        while True:
            with self._mutex:
                wait = max(self._last, started) + quiet - time.monotonic()
            if wait <= 0 or time.monotonic() > started + IO_TIMEOUT:
                return
            time.sleep(wait)

    def mark(self) -> None:
        """Start a new operation: :meth:`recorded` returns only what is sent after this."""
        self.sync()
        with self._mutex:
            for links in self._links:
                for link in links:
                    link.mark = len(link.sent)

    def recorded(self) -> list[list[tuple[int, bytes]]]:
        """Per master, (link number, bytes sent since the mark) for each link that sent any."""
        self.sync()
        with self._mutex:
            return [
                [(link.number, bytes(link.sent[link.mark :])) for link in links if len(link.sent) > link.mark]
                for links in self._links
            ]

    # -- the thread ---------------------------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # the thread is gone: stop() and sync() say why
            self._wake_w.send(b"x")

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._serve(None)
                if self._syncs:
                    while self._serve(0):  # everything already queued, before answering
                        pass
                    while self._syncs:
                        self._syncs.popleft().set()
        except BaseException as exc:
            self._failure = exc
        finally:
            self._shut()

    def _serve(self, timeout: float | None) -> int:
        """Handle what is ready within ``timeout``; how many sockets had data or a connection."""
        served = 0
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                self._wake_r.recv(CHUNK)
            elif isinstance(key.data, int):
                self._accept(key.data)
                served += 1
            else:
                link, upstream_side = key.data
                self._forward(link, upstream_side)
                served += 1
        return served

    def _shut(self) -> None:
        for links in self._links:
            for link in links:
                self._close(link)
        for listener in self._listeners:
            listener.close()
        self._wake_r.close()
        self._selector.close()

    def _accept(self, index: int) -> None:
        try:
            client, _ = self._listeners[index].accept()
        except OSError:
            return  # the client gave up before we took its connection
        try:
            upstream = socket.create_connection(self.targets[index], timeout=IO_TIMEOUT)
        except OSError:
            client.close()  # the client sees the master refuse, as it would without us
            return
        for sock in (client, upstream):
            sock.settimeout(IO_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._mutex:
            link = _Link(len(self._links[index]) + 1, client, upstream)
            self._links[index].append(link)
        self._selector.register(client, selectors.EVENT_READ, (link, False))
        self._selector.register(upstream, selectors.EVENT_READ, (link, True))

    def _forward(self, link: _Link, upstream_side: bool) -> None:
        source, target = (link.upstream, link.client) if upstream_side else (link.client, link.upstream)
        try:
            data = source.recv(CHUNK)
            if data and not upstream_side:
                with self._mutex:
                    link.sent += data
                    self._last = time.monotonic()
            if data:
                target.sendall(data)
                return
        except OSError:
            pass
        self._close(link)

    def _close(self, link: _Link) -> None:
        for sock in (link.client, link.upstream):
            if sock.fileno() >= 0:
                self._selector.unregister(sock)
                sock.close()
