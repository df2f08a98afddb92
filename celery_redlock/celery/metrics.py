"""Prometheus metrics of locking, built on the lock signals (the ``metrics`` extra).

Turned on by one setting, ``redlock_metrics`` (see :func:`.settings.metrics_setting`), or one
call, :func:`enable`. Until then nothing is connected: the task's hot path sends no signal
payload when a signal has no receiver (``if signals.lock_acquired.receivers``), the heartbeat
reads one global per beat, and prometheus-client is not even imported.

What is counted, and from where:

==========================================  ===================================================
``redlock_acquisitions_total{task,outcome}``  each lock attempt of a run: ``acquired``, ``held``
                                              (another holder has it) or ``no_quorum`` (too few
                                              masters answered); from ``lock_acquired`` and
                                              ``lock_contended``
``redlock_contended_total{task,policy}``      what a contended run did next (``retry``,
                                              ``skip``, ``fail``, ``exhausted``)
``redlock_acquire_seconds{task}``             histogram: from the run's start to its lock held
``redlock_held_locks{task}``                  gauge: locks held now (live processes summed)
``redlock_held_seconds{task}``                histogram: how long each run held its lock
``redlock_lost_total{task}``                  locks lost while the body ran (``lock_lost``)
``redlock_master_errors_total{master,kind}``  a master's ``error`` or ``timeout`` votes in the
                                              rounds that took (or failed to take) a run's lock
``redlock_heartbeat_lag_seconds``             histogram: how late each heartbeat began after
                                              its first lock came due
``redlock_heartbeat_ttl_used_ratio``          histogram: the share of its TTL a lock had used up
                                              when the heartbeat extended it (about 1/3 when
                                              healthy; near 1, the lock nearly expired)
``redlock_heartbeat_extensions_total{result}`` ``extended`` or ``failed``
``redlock_master_up{master}``                 at scrape time, in the serving process: one
``redlock_master_rtt_seconds{master}``        TIME per master (served by this module only)
==========================================  ===================================================

Prefork: each pool child counts in a process of its own, so the metrics use prometheus-client's
multiprocess mode. When a worker serves them (``redlock_metrics`` a port) and
``PROMETHEUS_MULTIPROC_DIR`` is not set, the main process sets it to a new directory before
prometheus-client is first imported, so the children inherit it; the endpoint then sums every
process's files (``MultiProcessCollector``). A child that exits normally marks itself dead (its
``held_locks`` gauge then stops counting); a SIGKILLed child's gauge stays until the directory is
cleared, as prometheus-client documents for every multiprocess user.

The endpoint is served by a process of its own, forked at ``worker_init`` while the worker's
main process has no thread but its main one (:class:`ServerProcess`). Served from a thread of
the main process, it would be alive at every later ``fork`` of that process: each pool child
the pool starts or replaces would begin as the copy of a multi-threaded process (Python 3.12
warns of it: "This process is multi-threaded, use of fork() may lead to deadlocks in the
child"), and a scrape could hold a mutex at that moment that the child then finds taken.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal as unix_signal
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NoReturn

from celery import signals as celery_signals

from .._fork import on_fork_in_child
from ..errors import ConfigError
from ..lock import heartbeat
from ..lock.admin import round_trips
from ..lock.redlock import Redlock
from ..lock.resource import Lock
from . import signals
from .runstate import run_of
from .settings import metrics_setting, read_settings

logger = logging.getLogger("celery_redlock.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Seconds; the acquire buckets reach from a loopback round to a long "wait" mode wait.
ACQUIRE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
HELD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

_metrics: _Metrics | None = None
_server: ServerProcess | None = None  # the worker's metrics endpoint, stopped with the worker


class _Metrics:
    """The metric objects, made once per process by :func:`enable`."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        self.acquisitions = Counter(
            "redlock_acquisitions", "Lock attempts of task runs, by outcome.", ["task", "outcome"], **kw
        )
        self.contended = Counter(
            "redlock_contended", "Contended task runs, by what they did next.", ["task", "policy"], **kw
        )
        self.acquire_seconds = Histogram(
            "redlock_acquire_seconds",
            "From a run's start to its lock held.",
            ["task"],
            buckets=ACQUIRE_BUCKETS,
            **kw,
        )
        self.held = Gauge(
            "redlock_held_locks", "Locks held by task runs now.", ["task"], multiprocess_mode="livesum", **kw
        )
        self.held_seconds = Histogram(
            "redlock_held_seconds", "How long each run held its lock.", ["task"], buckets=HELD_BUCKETS, **kw
        )
        self.lost = Counter("redlock_lost", "Locks lost while the body ran.", ["task"], **kw)
        self.master_errors = Counter(
            "redlock_master_errors",
            "Error and timeout votes of each master in task runs' lock rounds.",
            ["master", "kind"],
            **kw,
        )
        self.heartbeat_lag = Histogram(
            "redlock_heartbeat_lag_seconds",
            "How late each heartbeat began after its first lock came due.",
            buckets=LAG_BUCKETS,
            **kw,
        )
        self.ttl_used = Histogram(
            "redlock_heartbeat_ttl_used_ratio",
            "Share of its TTL a lock had used when the heartbeat extended it.",
            buckets=RATIO_BUCKETS,
            **kw,
        )
        self.extensions = Counter(
            "redlock_heartbeat_extensions", "Heartbeat extensions, by result.", ["result"], **kw
        )

    # -- receivers (connected weakly by nothing: held strongly by dispatch_uid) --------------------
    def on_acquired(self, sender: Any = None, elapsed: float = 0.0, **_: Any) -> None:
        task = _task_name(sender)
        self.acquisitions.labels(task, "acquired").inc()
        self.acquire_seconds.labels(task).observe(elapsed)
        self.held.labels(task).inc()
        run = run_of(getattr(sender, "request", None))
        if run is not None and run.held is not None:
            self._count_votes(run.held.lock.last_votes)

    def on_contended(self, sender: Any = None, policy: str = "", error: Any = None, **_: Any) -> None:
        task = _task_name(sender)
        held_by_other = bool(getattr(error, "held_by_other", False))
        self.acquisitions.labels(task, "held" if held_by_other else "no_quorum").inc()
        self.contended.labels(task, policy).inc()
        self._count_votes(getattr(error, "votes", ()))

    def on_lost(self, sender: Any = None, **_: Any) -> None:
        self.lost.labels(_task_name(sender)).inc()

    def on_released(self, sender: Any = None, held_for: float = 0.0, **_: Any) -> None:
        task = _task_name(sender)
        self.held.labels(task).dec()
        self.held_seconds.labels(task).observe(held_for)

    def on_beat(self, lag: float, seen: list[tuple[Lock, float, bool]]) -> None:
        self.heartbeat_lag.observe(lag)
        for lock, left, extended in seen:
            self.ttl_used.observe(max(0.0, lock.ttl - left) / lock.ttl)
            self.extensions.labels("extended" if extended else "failed").inc()

    def _count_votes(self, votes: Any) -> None:
        for vote in votes:
            if vote.kind in ("error", "timeout"):
                self.master_errors.labels(vote.master, vote.kind).inc()


def _task_name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "")


def enable(registry: Any = None) -> None:
    """Count locking into prometheus-client's metrics from now on, in this process and in the
    processes it forks (idempotent). ``registry``: where the metrics are registered (default:
    prometheus-client's global one). In multiprocess mode, set ``PROMETHEUS_MULTIPROC_DIR``
    before the first call (or use ``redlock_metrics``, which does)."""
    global _metrics
    if _metrics is not None:
        return
    try:
        metrics = _Metrics(registry)
    except ImportError as exc:
        raise ConfigError(
            f"redlock_metrics needs the 'metrics' extra ({exc.name} is missing): "
            "python -m pip install 'celery-redlock[metrics]'"
        ) from None
    for signal, receiver in (
        (signals.lock_acquired, metrics.on_acquired),
        (signals.lock_contended, metrics.on_contended),
        (signals.lock_lost, metrics.on_lost),
        (signals.lock_released, metrics.on_released),
    ):
        signal.connect(receiver, weak=False, dispatch_uid=f"celery_redlock.metrics.{signal.name}")
    celery_signals.worker_process_shutdown.connect(
        _mark_dead, weak=False, dispatch_uid="celery_redlock.metrics.mark_dead"
    )
    heartbeat.observe_beats(metrics.on_beat)
    _metrics = metrics


def disable() -> None:
    """Stop counting (the metrics keep their values); for tests and for hosts that swap apps."""
    global _metrics
    metrics = _metrics
    if metrics is None:
        return
    for signal in (signals.lock_acquired, signals.lock_contended, signals.lock_lost, signals.lock_released):
        signal.disconnect(dispatch_uid=f"celery_redlock.metrics.{signal.name}")
    heartbeat.observe_beats(None)
    _metrics = None


def _mark_dead(**_: Any) -> None:
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


class MastersCollector:
    """At each scrape, one TIME to every master: ``redlock_master_up`` and
    ``redlock_master_rtt_seconds`` per master. Costs nothing between scrapes."""

    def __init__(self, redlock: Redlock, timeout: float = 1.0) -> None:
        self.redlock = redlock
        self.timeout = timeout

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("redlock_master_up", "Whether the master answered TIME.", labels=["master"])
        rtt = GaugeMetricFamily(
            "redlock_master_rtt_seconds", "Round-trip time of one TIME to the master.", labels=["master"]
        )
        for master, seconds in zip(
            self.redlock.masters, round_trips(self.redlock, timeout=self.timeout), strict=True
        ):
            up.add_metric([master.name], 0.0 if seconds is None else 1.0)
            if seconds is not None:
                rtt.add_metric([master.name], seconds)
        yield up
        yield rtt

    def describe(self) -> Iterator[Any]:
        return iter(())  # collected at scrape time only, never on registration


def serve(host: str, port: int, redlock: Redlock | None = None) -> Any:
    """Serve ``/metrics`` on ``host:port`` from this process: every process's metrics when
    ``PROMETHEUS_MULTIPROC_DIR`` is set (multiprocess mode), else this process's; plus the
    masters' state at scrape time when ``redlock`` is given. Returns the HTTP server."""
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    path = os.environ.get(MULTIPROC_ENV)
    if path:
        from prometheus_client import multiprocess

        registry: Any = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
    else:
        registry = REGISTRY
    if redlock is not None:
        registry.register(MastersCollector(redlock))
    started = start_http_server(port, addr=host or "0.0.0.0", registry=registry)
    return started[0] if isinstance(started, tuple) else started


class ServerProcess:
    """:func:`serve` in a process forked for it, which lives as long as this process does.

    It is forked before any thread of ours starts (``worker_init``), serves from threads of its
    own, and never forks. It reads its end of a pipe whose other end only this process holds
    (pipes are not inherited across exec, and every child forked later closes its copy: see
    :func:`_close_in_child`), so it ends when this process closes that end (:meth:`stop`) or
    dies, whatever signal its process group is sent: a Ctrl-C or a SIGTERM to the group leaves
    it serving through the worker's warm shutdown.
    """

    START_TIMEOUT = 10.0
    STOP_TIMEOUT = 5.0

    def __init__(self, host: str, port: int, redlock: Redlock | None = None) -> None:
        status_r, status_w = os.pipe()
        alive_r, self._alive = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(status_r)
            os.close(self._alive)
            _serve_until_eof(host, port, redlock, status_w, alive_r)
        os.close(status_w)
        os.close(alive_r)
        _inherited.append(self._alive)
        try:
            status = _read_within(status_r, self.START_TIMEOUT)
        finally:
            os.close(status_r)
        if status != "ok":
            self.stop()
            raise OSError(
                status
                or f"the metrics server process ended or did not answer within {self.START_TIMEOUT:g} s"
            )

    def stop(self) -> None:
        """End the serving process and reap it (killed if it has not ended within STOP_TIMEOUT)."""
        if self._alive in _inherited:
            _inherited.remove(self._alive)
            os.close(self._alive)
        deadline = time.monotonic() + self.STOP_TIMEOUT
        try:
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(self.pid, unix_signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.02)
        except ChildProcessError:  # reaped already
            pass


def _serve_until_eof(host: str, port: int, redlock: Redlock | None, status: int, alive: int) -> NoReturn:
    """The serving process: serve, report "ok" or why not, and exit once ``alive`` reads EOF."""
    code = 1
    try:
        with contextlib.suppress(ValueError):  # forked from another thread: signals stay as they are
            for signum in (unix_signal.SIGINT, unix_signal.SIGTERM, unix_signal.SIGHUP):
                unix_signal.signal(signum, unix_signal.SIG_IGN)
        try:
            serve(host, port, redlock)
        except Exception as exc:
            os.write(status, f"metrics server on {host or '*'}:{port}: {exc}".encode())
        else:
            os.write(status, b"ok")
            while os.read(alive, 1):
                pass
            code = 0
    finally:
        os._exit(code)


def _read_within(fd: int, timeout: float) -> str:
    ready, _, _ = select.select([fd], [], [], timeout)
    return os.read(fd, 4096).decode(errors="replace") if ready else ""


# This process's ends of the serving processes' pipes: closed in every child forked from it, so
# that only this process keeps a serving process alive.
_inherited: list[int] = []


def _close_in_child() -> None:
    for fd in _inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    _inherited.clear()


on_fork_in_child(_close_in_child)


def _multiprocess_dir() -> None:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` to a new directory, if it is not set and prometheus-client
    has not been imported yet (it reads the variable at import)."""
    if os.environ.get(MULTIPROC_ENV):
        return
    if "prometheus_client" in sys.modules:
        logger.warning(
            "redlock_metrics: prometheus_client was imported before the worker started and %s is "
            "not set, so a prefork pool's children count where this endpoint cannot see; set %s "
            "in the worker's environment",
            MULTIPROC_ENV,
            MULTIPROC_ENV,
        )
        return
    os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="redlock-metrics-")


def worker_init(sender: Any = None, **_: Any) -> None:
    """``worker_init`` (main process, before the pool forks): turn the metrics on as
    ``redlock_metrics`` says, and serve them when it names a port."""
    global _server
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        setting = metrics_setting(app.conf.get("redlock_metrics"))
        if setting is False:
            return
        redlock = None
        if isinstance(setting, tuple):
            _multiprocess_dir()
            redlock = read_settings(app.conf).redlock()
        enable()
        if isinstance(setting, tuple):
            host, port = setting
            _server = ServerProcess(host, port, redlock)
            logger.info(
                "redlock metrics served on %s:%d/metrics by process %d", host or "*", port, _server.pid
            )
    except (ConfigError, OSError) as exc:
        # Celery's signal dispatch swallows an Exception; SystemExit stops the worker.
        raise SystemExit(f"celery-redlock: the worker cannot start: {exc}") from None


def worker_shutdown(**_: Any) -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        server.stop()
