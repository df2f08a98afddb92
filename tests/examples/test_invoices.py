"""The invoices example (the README's quickstart) on two real prefork workers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_redlock.testing import CeleryWorker, RedisServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "invoices"


@pytest.fixture
def invoices_env(redlock_master_urls: list[str], tmp_path: Path) -> Iterator[dict[str, str]]:
    with RedisServer() as broker:
        yield {
            "CELERY_BROKER_URL": broker.url,
            "CELERY_RESULT_BACKEND": broker.url.replace("/0", "/1"),
            "REDLOCK_MASTERS": ",".join(redlock_master_urls),
            "INVOICES_DB": str(tmp_path / "invoices.sqlite3"),
        }


@pytest.mark.timeout(150)
def test_every_invoice_is_charged_once_however_often_it_is_sent(invoices_env: dict[str, str]) -> None:
    workers = [
        CeleryWorker("tasks", concurrency=2, env=invoices_env, cwd=EXAMPLE, pythonpath=[EXAMPLE])
        for _ in range(2)
    ]
    try:
        for worker in workers:
            worker.start(wait=False)
        for worker in workers:
            worker.wait_ready()
        result = subprocess.run(
            [sys.executable, "submit.py", "--invoices", "12", "--copies", "5", "--timeout", "90"],
            cwd=EXAMPLE,
            env={**os.environ, **invoices_env},
            capture_output=True,
            text=True,
            timeout=110,
        )
    finally:
        for worker in workers:
            worker.cleanup()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "12 charged, 48 found the invoice already paid" in result.stdout
    assert "12 invoices charged, 0 charged more than once" in result.stdout
