"""The ASGI example (examples/asgi/app.py) as a user runs it: a real uvicorn with two worker
processes on a loopback port, driven over HTTP by concurrent requests.

Forty concurrent builds of one report, spread over both workers, each a read-modify-write with a
sleep inside: every build is counted and none overlapped another. A build that will not wait
while another runs gets 409, naming the holder."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server(redlock_master_urls: list[str], tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    env = {
        **os.environ,
        "REDLOCK_MASTERS": ",".join(redlock_master_urls),
        "REPORTS_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    command = [sys.executable, "-m", "uvicorn", "examples.asgi.app:app", "--host", "127.0.0.1"]
    # Its output goes to a file, never to a pipe that nobody reads while the test runs: a worker
    # whose write to a full pipe blocks stops its whole event loop, every request with it. The
    # file is printed at the end, which pytest shows for a test that failed.
    log_path = tmp_path / "uvicorn.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [*command, "--port", str(port), "--workers", "2", "--log-level", "warning"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its worker processes are in its group: stopped with it
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/reports/warmup", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"uvicorn did not come up: {log_path.read_text(errors='replace')}")
            time.sleep(0.1)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
        log.close()
        print(f"uvicorn's output:\n{log_path.read_text(errors='replace')[-20000:]}")


def test_concurrent_builds_over_two_workers_never_overlap(server: str) -> None:
    async def main() -> tuple[list[int], dict[str, object], set[str]]:
        # 40 connections at once: the two workers accept them from one listening socket.
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server, timeout=30, limits=limits) as client:
            replies = await asyncio.gather(
                *(client.post("/reports/q3", params={"wait": 25}) for _ in range(40))
            )
            shown = (await client.get("/reports/q3")).json()
        return [r.status_code for r in replies], shown, {str(r.json()["builds"]) for r in replies}

    statuses, shown, counts = asyncio.run(main())
    assert statuses == [200] * 40
    assert shown == {"report": "q3", "builds": 40, "overlaps": 0}
    assert counts == {str(k) for k in range(1, 41)}  # every build saw its predecessor's write


def test_a_build_that_will_not_wait_is_refused_naming_the_holder(server: str) -> None:
    async def main() -> tuple[int, dict[str, str], int]:
        async with httpx.AsyncClient(base_url=server, timeout=30) as client:
            long = asyncio.create_task(client.post("/reports/yearly", params={"hold": 1.5}))
            await asyncio.sleep(0.5)
            refused = await client.post("/reports/yearly", params={"wait": 0})
            return refused.status_code, refused.json(), (await long).status_code

    status, body, long_status = asyncio.run(main())
    assert status == 409 and long_status == 200
    assert "not acquired" in body["error"]
    assert "build of yearly on" in body["holder"] and " pid " in body["holder"]


def test_a_wait_or_hold_that_is_not_a_sane_number_of_seconds_is_refused_naming_it(server: str) -> None:
    """The example checks its query parameters: an endless wait, a build longer than the lock's
    TTL, or text would otherwise hang a request, lose the lock mid-build or answer 500."""

    async def main() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=server, timeout=30) as client:
            answers = []
            for params in ({"wait": "inf"}, {"wait": "nan"}, {"wait": "soon"}, {"hold": 60}, {"wait": -1}):
                reply = await client.post("/reports/checked", params=params)
                answers.append((reply.status_code, reply.json()["error"]))
            return answers

    answers = asyncio.run(main())
    assert [status for status, _ in answers] == [400] * 5, answers
    assert [error.split()[0] for _, error in answers] == ["wait", "wait", "wait", "hold", "wait"]
