"""Real ``celery worker`` and ``celery beat`` processes for tests and demos, controlled by pid.

Each process runs ``python -m celery -A <module> ...`` in a session of its own, so ``stop()``,
``kill()``, ``pause()`` and ``resume()`` reach the pool children too (they share its process
group), and nothing a test starts outlives it. Output goes to a log file; readiness is decided by
polling that log for the line Celery writes once it consumes (worker) or schedules (beat), with a
deadline, never by sleeping.

    with CeleryWorker("tests.celery.tasks", pool="prefork", concurrency=2,
                      env={"BROKER_URL": url}, pythonpath=[root]) as worker:
        worker.child_pids()   # the prefork pool's children
        worker.pause()        # SIGSTOP the whole group
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

logger = logging.getLogger("celery_redlock.testing")

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
POLL = 0.05

_counter = itertools.count(1)

# Every process started here that may still run, for ask_all_to_stop, by id(): held weakly (a
# process object its owner dropped is not kept alive by this) and never hashed (a subclass may
# define __eq__). The mutex lets a thread start a process while another asks them all to stop.
_started: weakref.WeakValueDictionary[int, CeleryProcess] = weakref.WeakValueDictionary()
_started_mutex = threading.Lock()


class CeleryProcessError(RuntimeError):
    """A Celery process did not start, or exited when it should not have; carries its log."""


class CeleryProcess:
    """One ``celery -A <module> <command>`` subprocess in a session of its own.

    Subclasses say which command, and which log line means ready.
    """

    command: str = ""
    ready_pattern: str = ""

    def __init__(
        self,
        app_module: str,
        *,
        args: Sequence[str] = (),
        loglevel: str = "INFO",
        env: Mapping[str, str] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        cwd: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        python: str | None = None,
    ) -> None:
        self.app_module = app_module
        self.args = list(args)
        self.loglevel = loglevel
        self.extra_env = dict(env or {})
        self.pythonpath = [str(p) for p in pythonpath]
        self.name = name or f"{self.command}{next(_counter)}"
        self.python = python or sys.executable
        self._own_dir = log_dir is None
        self.dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix=f"celery-{self.name}-"))
        )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cwd = str(cwd) if cwd is not None else str(self.dir)
        self.log_path = self.dir / f"{self.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_offset = 0
        self.paused = False

    # -- identity -------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def __repr__(self) -> str:
        state = "paused" if self.paused else ("running" if self.running else "stopped")
        return f"<{type(self).__name__} {self.name} -A {self.app_module} pid={self.pid} {state}>"

    def argv(self) -> list[str]:
        """The full command line."""
        return [
            self.python,
            "-m",
            "celery",
            "-A",
            self.app_module,
            self.command,
            "--loglevel",
            self.loglevel,
            *self._command_args(),
            *self.args,
        ]

    def _command_args(self) -> list[str]:
        return []

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        paths = [*self.pythonpath]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        # Unbuffered, so the log shows what happened up to a kill.
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, *, wait: bool = True, timeout: float = START_TIMEOUT) -> CeleryProcess:
        """Start the process; with ``wait``, return once it logged that it is ready."""
        if self.running:
            return self
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stop()
        self._log_offset = self.log_path.stat().st_size
        with _started_mutex:  # before it exists: nothing can fail between its start and this
            _started[id(self)] = self
        self._proc = subprocess.Popen(
            self.argv(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            cwd=self.cwd,
            start_new_session=True,
        )
        self.paused = False
        logger.debug("started %r: %s", self, " ".join(self.argv()))
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.kill()
                raise
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Poll the log for the ready line until ``timeout``; raise with the log if it never comes."""
        if self.loglevel.upper() in ("WARNING", "WARN", "ERROR", "CRITICAL", "FATAL"):
            raise CeleryProcessError(
                f"{self!r}: readiness is read from the INFO log line; with loglevel "
                f"{self.loglevel} start it with wait=False and wait another way (app.control.ping)"
            )
        self.wait_for_log(self.ready_pattern, timeout, since_start=True)

    def wait_for_log(
        self, pattern: str, timeout: float = 10.0, *, since_start: bool = False, count: int = 1
    ) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) occurs ``count`` times in the log; return the last match.

        ``since_start`` looks only at output of the current run (after the last ``start()``).
        Raises :class:`CeleryProcessError` if the process exits or the deadline passes first.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_text()
            if since_start:
                text = text[self._log_offset :]
            matches = list(regex.finditer(text))
            if len(matches) >= count:
                return matches[count - 1]
            if self._proc is not None and self._proc.poll() is not None:
                raise CeleryProcessError(
                    f"{self!r} exited with {self._proc.returncode} before /{pattern}/ appeared; "
                    f"log tail:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise CeleryProcessError(
                    f"/{pattern}/ did not appear in {self!r}'s log within {timeout}s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(POLL)

    def log_text(self) -> str:
        """Everything the process (and its pool children) wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def child_pids(self) -> list[int]:
        """Pids of the direct children (the prefork pool's processes); [] for solo/threads."""
        if self.pid is None:
            return []
        return _children(self.pid)

    def descendant_pids(self) -> list[int]:
        """Every process below the main one, breadth first."""
        found: list[int] = []
        frontier = self.child_pids()
        while frontier:
            found += frontier
            frontier = [c for pid in frontier for c in _children(pid)]
        return found

    def _signal_group(self, signum: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signum)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM the group (warm shutdown), wait up to ``timeout``, then SIGKILL what is left."""
        if self._proc is None:
            return None
        self._ask_to_stop()
        return self._finish_stop(time.monotonic() + timeout)

    def _ask_to_stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGCONT)
            self._signal_group(signal.SIGTERM)

    def _finish_stop(self, deadline: float) -> int | None:
        assert self._proc is not None
        try:
            self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%r did not stop by its deadline; killing it", self)
        self._kill_group()
        self.paused = False
        self._close_log()
        return self._proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once: no shutdown code runs anywhere."""
        if self._proc is None:
            return
        self._kill_group()
        self.paused = False
        self._close_log()

    def _kill_group(self) -> None:
        assert self._proc is not None
        # Children left behind by a main process that already exited still carry its group id.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)

    def pause(self) -> None:
        """SIGSTOP the main process and its pool children: nothing runs, nothing is extended."""
        self._signal_group(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)
        self.paused = False

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def cleanup(self) -> None:
        """Stop the process and remove the directory it was given by default."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> CeleryProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CeleryWorker(CeleryProcess):
    """``celery -A <module> worker``: ready once it logs ``<hostname> ready.``."""

    command = "worker"

    def __init__(
        self,
        app_module: str,
        *,
        pool: str = "prefork",
        concurrency: int | None = 2,
        hostname: str | None = None,
        queues: Sequence[str] = (),
        without_heartbeat: bool = True,
        **options: object,
    ) -> None:
        super().__init__(app_module, **options)  # type: ignore[arg-type]
        self.pool = pool
        self.concurrency = concurrency
        # Unique per instance, so two workers on one host never clash in the broker's eyes.
        self.hostname = hostname or f"{self.name}-{uuid.uuid4().hex[:8]}@127.0.0.1"
        self.queues = list(queues)
        self.without_heartbeat = without_heartbeat
        self.ready_pattern = re.escape(self.hostname) + r" ready\."

    def _command_args(self) -> list[str]:
        args = ["--pool", self.pool, "--hostname", self.hostname]
        if self.concurrency is not None:
            args += ["--concurrency", str(self.concurrency)]
        if self.queues:
            args += ["--queues", ",".join(self.queues)]
        if self.without_heartbeat:
            # Gossip, mingle and event heartbeats only slow start-up and add broker chatter.
            args += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
        return args

    def __enter__(self) -> CeleryWorker:
        self.start()
        return self


class CeleryBeat(CeleryProcess):
    """``celery -A <module> beat``: its schedule file in its own directory, no pidfile."""

    command = "beat"
    ready_pattern = r"beat: Starting\.\.\."

    def __init__(
        self,
        app_module: str,
        *,
        scheduler: str | None = None,
        max_interval: int | None = 1,
        **options: object,
    ) -> None:
        super().__init__(app_module, **options)  # type: ignore[arg-type]
        self.scheduler = scheduler
        self.max_interval = max_interval

    def _command_args(self) -> list[str]:
        args = ["--schedule", str(self.dir / f"{self.name}-schedule")]
        if self.scheduler is not None:
            args += ["--scheduler", self.scheduler]
        if self.max_interval is not None:
            args += ["--max-interval", str(self.max_interval)]
        return args

    def __enter__(self) -> CeleryBeat:
        self.start()
        return self


def stop_all(processes: Sequence[CeleryProcess], timeout: float = STOP_TIMEOUT) -> None:
    """Stop several processes on one deadline: all are asked at once, so n of them cost one wait.

    A warm shutdown waits for the tasks still running; stopping one process after another would
    add those waits up (a session's worker pools took past a test's time limit that way).
    """
    started = [p for p in processes if p._proc is not None]
    for process in started:
        process._ask_to_stop()
    deadline = time.monotonic() + timeout
    for process in started:
        process._finish_stop(deadline)


def ask_all_to_stop() -> None:
    """Ask every process started here that still runs to stop (a warm shutdown), and return
    at once: whoever stops each one then waits only for what is left of its shutdown.

    For the end of a test session, when every fixture's processes are to go: asked together,
    their shutdowns overlap, where fixtures stopping theirs one after another add them up.
    """
    with _started_mutex:
        processes = list(_started.values())
    for process in processes:
        process._ask_to_stop()  # one that has ended, or never started, is left as it is


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (every thread's list), else from ``ps``."""
    task_dir = Path(f"/proc/{pid}/task")
    if task_dir.is_dir():
        found: list[int] = []
        for thread in task_dir.iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (thread / "children").read_text().split()]
        if found or Path(f"/proc/{pid}/task/{pid}/children").exists():
            return sorted(set(found))
    try:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(int(p) for p in out.split())
