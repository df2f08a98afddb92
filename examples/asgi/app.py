"""AsyncRedlock in a web app: one report is built by one request at a time, fleet-wide.

A Starlette app (any ASGI server; uvicorn here) whose ``POST /reports/{name}`` rebuilds a
report: a read-modify-write of a counter in a plain file, which is only correct if no two builds
of one report overlap, in any worker process. The lock makes it so. Run it with uvicorn and as
many worker processes as you like, against your masters:

    REDLOCK_MASTERS=redis://m1:6379,redis://m2:6379,redis://m3:6379 \\
        REPORTS_DIR=/tmp/reports uvicorn examples.asgi.app:app --workers 4

    curl -X POST 'localhost:8000/reports/q3?wait=10'     # waits up to 10 s for the lock
    curl -X POST 'localhost:8000/reports/q3?wait=0'      # 409 at once if a build is running
    curl localhost:8000/reports/q3                        # how many builds ran, and overlaps

One :class:`AsyncRedlock` per worker process, opened and closed with the app (its lifespan),
shared by every request: its connections and its listening links (a waiting request is woken
by the release, not by polling) serve them all. A request that cannot get the lock in time gets
409 and the error's text, which names the holder (the ``holder`` each build passes).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from celery_redlock import AsyncRedlock, LockNotAcquired

REPORTS = Path(os.environ.get("REPORTS_DIR", "reports"))
BUILD_SECONDS = float(os.environ.get("BUILD_SECONDS", "0.005"))  # the window a second build needs


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    masters = os.environ.get("REDLOCK_MASTERS", "redis://127.0.0.1:6379").split(",")
    REPORTS.mkdir(parents=True, exist_ok=True)
    async with AsyncRedlock(masters, ttl=10.0) as redlock:
        app.state.redlock = redlock
        yield


async def build(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    try:
        wait = _seconds(request, "wait", 10.0, most=60.0)
        # A build must end well inside the lock's TTL (10 s): this example does not extend it.
        hold = _seconds(request, "hold", BUILD_SECONDS, most=5.0)
    except ValueError as bad:
        return JSONResponse({"error": str(bad)}, status_code=400)
    redlock: AsyncRedlock = request.app.state.redlock
    holder = f"build of {name} on {socket.gethostname()} pid {os.getpid()}"
    lock = redlock.lock(
        f"report:{name}", timeout=wait if wait > 0 else None, blocking=wait > 0, holder=holder
    )
    try:
        async with lock:
            count = _enter(name)  # tiny local files: read and written in the loop
            try:
                await asyncio.sleep(hold)  # the build: reading, rendering, writing
                lock.ensure()  # still held (validity left): only then is the result written
                (REPORTS / f"{name}.count").write_text(str(count + 1))
            finally:
                _leave(name)
    except LockNotAcquired as refused:
        return JSONResponse(
            {"error": str(refused).splitlines()[0], "holder": refused.holder}, status_code=409
        )
    return JSONResponse({"report": name, "builds": count + 1})


def _seconds(request: Request, name: str, default: float, most: float) -> float:
    """Query parameter ``name`` as seconds from 0 to ``most``; a ValueError that names it."""
    text = request.query_params.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= most:  # NaN fails both comparisons
        raise ValueError(f"{name} must be a number of seconds from 0 to {most:g}, got {text!r}")
    return value


async def show(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    builds, overlaps = _read(REPORTS / f"{name}.count"), _read(REPORTS / f"{name}.overlaps")
    return JSONResponse({"report": name, "builds": builds, "overlaps": overlaps})


def _enter(name: str) -> int:
    """Read the counter; mark the build as running, and count an overlap if one already was."""
    try:
        os.close(os.open(REPORTS / f"{name}.running", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        _bump(REPORTS / f"{name}.overlaps")  # another build is inside: the lock failed
    return _read(REPORTS / f"{name}.count")


def _leave(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(REPORTS / f"{name}.running")


def _read(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except FileNotFoundError:
        return 0


def _bump(path: Path) -> None:
    path.write_text(str(_read(path) + 1))


app = Starlette(
    routes=[
        Route("/reports/{name}", build, methods=["POST"]),
        Route("/reports/{name}", show, methods=["GET"]),
    ],
    lifespan=lifespan,
)
