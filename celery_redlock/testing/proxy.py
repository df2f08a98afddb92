"""A loopback TCP proxy owned by the tests, in front of one master, with network faults on demand.

Clients connect to the proxy's port instead of the master's. Each :class:`Proxy` listens on its
own port, so giving two groups of clients two proxies for the same master lets a test show
*different clients different majorities*: :class:`ProxySet` is one proxy per master for one group.

Faults (each control call returns once the proxy thread has applied it):

- ``delay(seconds, direction)``: every byte waits that long before it is passed on, in order;
  ``direction`` is ``"up"`` (requests), ``"down"`` (replies) or ``"both"``.
- ``blackhole()``: connections are accepted and kept open, nothing is passed on in either
  direction. Bytes are held, and delivered after ``heal()``, as TCP retransmission would deliver
  them once a partition heals.
- ``drop()``: like ``blackhole`` but bytes are thrown away. A connection that lost bytes carries a
  corrupt stream, so ``heal()`` resets it.
- ``cut()``: every connection is reset (RST), and so is every new one until ``heal()``.
- ``heal()``: back to plain forwarding with no delay.

One thread per proxy, driven by ``selectors``; connections to the master are made without
blocking, so a master that accepts slowly stalls no other connection.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

from .._validate import choice, number

logger = logging.getLogger("celery_redlock.testing.proxy")

Direction = Literal["up", "down", "both"]
Mode = Literal["forward", "blackhole", "drop", "cut"]
CHUNK = 65536
CONTROL_TIMEOUT = 5.0
_EOF = b""  # queued after a side's last bytes: pass the close on once they are delivered


def _parse_target(target: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(target, tuple):
        return target[0], int(target[1])
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"proxy target must be 'host:port' or (host, port), got {target!r}")
    return host, int(port)


def _reset(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN, as a dropped connection looks to its peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Flow:
    """Bytes travelling one way through one connection, each chunk with the time it is due."""

    __slots__ = ("out", "queue")

    def __init__(self) -> None:
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.out = b""  # the part of the current chunk the destination has not taken yet

    def pending(self) -> int:
        return len(self.out) + sum(len(chunk) for _, chunk in self.queue)


class _Pipe:
    """One client connection and its connection to the master."""

    __slots__ = ("client", "connected", "down", "reading", "tainted", "up", "upstream")

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.connected = False
        self.up = _Flow()  # client -> master
        self.down = _Flow()  # master -> client
        self.tainted = False  # bytes were dropped: the stream is corrupt
        self.reading = {"client": True, "upstream": True}  # False once that side sent its FIN


class Proxy:
    """A TCP proxy on a free loopback port forwarding to ``target``; a context manager."""

    def __init__(
        self,
        target: str | tuple[str, int],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "",
    ) -> None:
        self.target = _parse_target(target)
        self.host = host
        self.name = name or f"proxy->{self.target[0]}:{self.target[1]}"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._controls: collections.deque[tuple[Callable[[], None], threading.Event]] = collections.deque()
        self._control_mutex = threading.Lock()
        self._pipes: list[_Pipe] = []
        self._mode: Mode = "forward"
        self._delay = {"up": 0.0, "down": 0.0}
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- identity -------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def mode(self) -> Mode:
        return self._mode

    def __repr__(self) -> str:
        delay = (
            f" delay up={self._delay['up']}s down={self._delay['down']}s" if any(self._delay.values()) else ""
        )
        return f"<Proxy {self.address} -> {self.target[0]}:{self.target[1]} {self._mode}{delay}>"

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Proxy:
        if self._thread is None:
            self._selector.register(self._listener, selectors.EVENT_READ, "listen")
            self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and reset every connection."""
        if self._thread is not None and self._thread.is_alive():
            self._control(self._shutdown)
            self._thread.join(CONTROL_TIMEOUT)
        else:
            self._shutdown()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- controls -------------------------------------------------------------------------------
    def delay(self, seconds: float, direction: Direction = "both") -> None:
        """Hold every byte ``seconds`` before passing it on (new bytes; queued ones keep theirs)."""
        seconds = number("delay", seconds, at_least=0, unit="seconds")
        choice("direction", direction, ("up", "down", "both"))

        def apply() -> None:
            for side in ("up", "down") if direction == "both" else (direction,):
                self._delay[side] = float(seconds)

        self._control(apply)

    def blackhole(self) -> None:
        """Accept and hold connections open; pass nothing on until :meth:`heal`."""
        self._control(lambda: self._set_mode("blackhole"))

    def drop(self) -> None:
        """Accept and hold connections open; throw every byte away until :meth:`heal`."""
        self._control(lambda: self._set_mode("drop"))

    def cut(self) -> None:
        """Reset every connection now, and every new one until :meth:`heal`."""
        self._control(lambda: self._set_mode("cut"))

    def heal(self) -> None:
        """Forward again with no delay; held bytes are delivered, corrupted streams reset."""

        def apply() -> None:
            self._delay = {"up": 0.0, "down": 0.0}
            self._set_mode("forward")

        self._control(apply)

    def pending(self) -> int:
        """Bytes accepted but not yet delivered, in both directions, over all connections."""
        result: list[int] = []
        self._control(lambda: result.append(sum(p.up.pending() + p.down.pending() for p in self._pipes)))
        return result[0]

    def connections(self) -> int:
        result: list[int] = []
        self._control(lambda: result.append(len(self._pipes)))
        return result[0]

    def _control(self, action: Callable[[], None]) -> None:
        """Run ``action`` on the proxy thread and wait until it has run."""
        if self._thread is None or self._closing:
            action()
            return
        if not self._thread.is_alive():
            # A dead thread forwards nothing: answering from here would report bytes held for ever.
            raise RuntimeError(f"{self.name}: the proxy thread has died (its exception is logged)")
        done = threading.Event()
        with self._control_mutex:
            self._controls.append((action, done))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if not done.wait(CONTROL_TIMEOUT):
            raise RuntimeError(f"{self.name}: the proxy thread did not apply a control in time")

    # -- the thread -----------------------------------------------------------------------------
    def _set_mode(self, mode: Mode) -> None:
        previous, self._mode = self._mode, mode
        logger.debug("%s: %s -> %s", self.name, previous, mode)
        if mode == "cut":
            for pipe in list(self._pipes):
                self._close_pipe(pipe, reset=True)
        elif mode == "drop":
            for pipe in self._pipes:
                if pipe.up.pending() or pipe.down.pending():
                    pipe.tainted = True
                pipe.up = _Flow()
                pipe.down = _Flow()
        elif mode == "forward":
            for pipe in list(self._pipes):
                if pipe.tainted:
                    self._close_pipe(pipe, reset=True)
                elif pipe.upstream is None:
                    self._connect_upstream(pipe)
        for pipe in self._pipes:
            self._update_interest(pipe)

    def _shutdown(self) -> None:
        self._closing = True
        for pipe in list(self._pipes):
            self._close_pipe(pipe, reset=True)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()

    def _run(self) -> None:
        try:
            while not self._closing:
                timeout = self._next_due()
                for key, mask in self._selector.select(timeout):
                    self._dispatch(key.data, key.fileobj, mask)  # type: ignore[arg-type]
                    if self._closing:
                        return
                self._flush_all()
        except Exception:  # a proxy bug must show in the test log, not vanish with the thread
            logger.exception("%s: proxy thread failed", self.name)
            raise

    def _next_due(self) -> float | None:
        if self._mode != "forward":
            return None
        earliest: float | None = None
        for pipe in self._pipes:
            for flow in (pipe.up, pipe.down):
                if flow.queue and not flow.out:
                    due = flow.queue[0][0]
                    earliest = due if earliest is None else min(earliest, due)
        if earliest is None:
            return None
        return max(0.0, earliest - time.monotonic())

    def _dispatch(self, data: object, sock: socket.socket, mask: int) -> None:
        if data == "wake":
            self._run_controls()
        elif data == "listen":
            self._accept()
        else:
            assert isinstance(data, tuple)
            pipe: _Pipe = data[0]
            side: str = data[1]
            if pipe not in self._pipes:
                return
            if mask & selectors.EVENT_WRITE:
                if side == "upstream" and not pipe.connected:
                    self._finish_connect(pipe)
                else:
                    self._flush(pipe)
            if pipe in self._pipes and mask & selectors.EVENT_READ:
                self._receive(pipe, side)

    def _run_controls(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            with self._control_mutex:
                if not self._controls:
                    return
                action, done = self._controls.popleft()
            try:
                action()
            finally:
                done.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. too many open files: keep serving the others
                logger.warning("%s: accept failed: %s", self.name, exc)
                return
            if self._mode == "cut":
                _reset(client)
                continue
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pipe = _Pipe(client)
            self._pipes.append(pipe)
            self._selector.register(client, selectors.EVENT_READ, (pipe, "client"))
            if self._mode == "forward":
                self._connect_upstream(pipe)

    def _connect_upstream(self, pipe: _Pipe) -> None:
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setblocking(False)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = upstream.connect_ex(self.target)
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            upstream.close()
            self._close_pipe(pipe, reset=True)
            return
        pipe.upstream = upstream
        pipe.connected = code == 0
        events = selectors.EVENT_READ if pipe.connected else selectors.EVENT_WRITE
        self._selector.register(upstream, events, (pipe, "upstream"))

    def _finish_connect(self, pipe: _Pipe) -> None:
        assert pipe.upstream is not None
        if pipe.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
            # The master is gone: the client sees its connection reset, as it would directly.
            self._close_pipe(pipe, reset=True)
            return
        pipe.connected = True
        self._update_interest(pipe)
        self._flush(pipe)

    def _receive(self, pipe: _Pipe, side: str) -> None:
        sock = pipe.client if side == "client" else pipe.upstream
        assert sock is not None
        try:
            chunk = sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_pipe(pipe, reset=True)
            return
        flow, direction = (pipe.up, "up") if side == "client" else (pipe.down, "down")
        if self._mode == "drop":
            if chunk:
                pipe.tainted = True
                return
            self._close_pipe(pipe, reset=True)
            return
        if not chunk:
            # Stop reading this side; its close travels behind the bytes already queued.
            pipe.reading[side] = False
            self._update_interest(pipe)
        due = time.monotonic() + self._delay[direction]
        if flow.queue:
            due = max(due, flow.queue[-1][0])
        flow.queue.append((due, chunk))
        if self._mode == "forward":
            self._flush(pipe)

    def _flush_all(self) -> None:
        if self._mode != "forward":
            return
        for pipe in list(self._pipes):
            if pipe in self._pipes:
                self._flush(pipe)

    def _flush(self, pipe: _Pipe) -> None:
        """Send every chunk that is due, in order, as far as the destinations take them."""
        if self._mode != "forward":
            return
        now = time.monotonic()
        for flow, dest in ((pipe.up, pipe.upstream), (pipe.down, pipe.client)):
            if dest is None or (dest is pipe.upstream and not pipe.connected):
                continue
            while True:
                if not flow.out:
                    if not flow.queue or flow.queue[0][0] > now:
                        break
                    _, chunk = flow.queue.popleft()
                    if chunk == _EOF:
                        self._close_pipe(pipe, reset=False)
                        return
                    flow.out = chunk
                try:
                    sent = dest.send(flow.out)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    self._close_pipe(pipe, reset=True)
                    return
                flow.out = flow.out[sent:]
                if flow.out:
                    break
        self._update_interest(pipe)

    def _update_interest(self, pipe: _Pipe) -> None:
        """Read while a side is open; wake for writing only where bytes wait for it."""
        forwarding = self._mode == "forward"
        for sock, side, flow in ((pipe.client, "client", pipe.down), (pipe.upstream, "upstream", pipe.up)):
            if sock is None or (side == "upstream" and not pipe.connected):
                continue  # an upstream still connecting stays registered for EVENT_WRITE
            events = selectors.EVENT_READ if pipe.reading[side] else 0
            if forwarding and flow.out:
                events |= selectors.EVENT_WRITE
            try:
                registered: int | None = self._selector.get_key(sock).events
            except KeyError:
                registered = None
            if events == registered:
                continue
            if not events:
                if registered is not None:
                    self._selector.unregister(sock)
            elif registered is None:
                self._selector.register(sock, events, (pipe, side))
            else:
                self._selector.modify(sock, events, (pipe, side))

    def _close_pipe(self, pipe: _Pipe, *, reset: bool) -> None:
        if pipe in self._pipes:
            self._pipes.remove(pipe)
        for sock in (pipe.client, pipe.upstream):
            if sock is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            if reset:
                _reset(sock)
            else:
                sock.close()


class ProxySet(Sequence[Proxy]):
    """One proxy per master for one group of clients; indexable like a list."""

    def __init__(self, targets: Iterable[str | tuple[str, int]], *, name: str = "") -> None:
        self.name = name
        self.proxies = [
            Proxy(target, name=f"proxy-{name}{i}" if name else "") for i, target in enumerate(targets)
        ]

    def __getitem__(self, index: int) -> Proxy:  # type: ignore[override]
        return self.proxies[index]

    def __len__(self) -> int:
        return len(self.proxies)

    def __iter__(self) -> Iterator[Proxy]:
        return iter(self.proxies)

    @property
    def urls(self) -> list[str]:
        return [proxy.url for proxy in self.proxies]

    def start(self) -> ProxySet:
        for proxy in self.proxies:
            proxy.start()
        return self

    def heal(self) -> None:
        for proxy in self.proxies:
            proxy.heal()

    def pending(self) -> int:
        return sum(proxy.pending() for proxy in self.proxies)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()

    def __enter__(self) -> ProxySet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
