"""docker-compose.yml, checked structurally (no container engine here): five independent,
fsync-always masters, and workers and beats whose app really is configured with those five."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with open(ROOT / "docker-compose.yml") as handle:
        loaded = yaml.safe_load(handle)  # resolves the x-master / x-app anchors
    assert isinstance(loaded, dict)
    return loaded


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else [str(part) for part in command]


def _option(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def _masters(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if "redis-server" in _command(s)}


def _celery(compose: dict[str, Any], role: str | None = None) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in compose["services"].items()
        if _command(s)[:1] == ["celery"] and (role is None or role in _command(s))
    }


def test_five_independent_masters_that_keep_every_granted_lock(compose: dict[str, Any]) -> None:
    masters = _masters(compose)
    assert len(masters) == 5, sorted(masters)
    volumes: list[str] = []
    for name, service in masters.items():
        command = _command(service)
        assert not {"--replicaof", "--slaveof", "replicaof", "slaveof"} & set(command), name
        assert _option(command, "--appendonly") == "yes", name
        assert _option(command, "--appendfsync") == "always", name
        assert "network_mode" not in service, name
        volumes += [v.split(":")[0] for v in service.get("volumes", [])]
    # One data volume each: two masters sharing a directory would not fail independently.
    assert len(volumes) == 5 and len(set(volumes)) == 5, volumes
    assert set(volumes) <= set(compose.get("volumes", {}))


def _app_settings(environment: dict[str, str]) -> dict[str, Any]:
    """The invoices app, imported as its worker would with the service's environment."""
    probe = (
        "import json; from tasks import app; from celery_redlock.celery.settings import read_settings; "
        "s = read_settings(app.conf); "
        "print(json.dumps({'masters': list(s.masters), 'broker': app.conf.broker_url}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT / "examples" / "invoices",
        env={**os.environ, **environment, "PYTHONPATH": "."},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.mark.timeout(120)
def test_workers_and_beats_lock_on_exactly_those_masters(compose: dict[str, Any]) -> None:
    masters = _masters(compose)
    workers, beats = _celery(compose, "worker"), _celery(compose, "beat")
    assert len(workers) >= 2 and len(beats) >= 1, sorted(compose["services"])
    for name, service in {**workers, **beats}.items():
        assert _option(_command(service), "-A") == "tasks", name
        settings = _app_settings({k: str(v) for k, v in service["environment"].items()})
        hosts = [(urlparse(u).hostname, urlparse(u).port) for u in settings["masters"]]
        assert sorted(hosts) == sorted((m, 6379) for m in masters), (name, hosts)
        broker = urlparse(settings["broker"]).hostname
        assert broker in compose["services"] and broker not in masters, (name, broker)
        assert set(masters) | {broker} <= set(service["depends_on"]), name
    for name, service in beats.items():
        assert _option(_command(service), "-S") == "celery_redlock.beat:RedlockScheduler", name


def test_the_image_runs_the_invoices_example(compose: dict[str, Any]) -> None:
    builds = {json.dumps(s["build"], sort_keys=True) for s in _celery(compose).values()}
    assert len(builds) == 1
    dockerfile = ROOT / json.loads(builds.pop())["dockerfile"]
    workdir = re.findall(r"^WORKDIR\s+(\S+)", dockerfile.read_text(), re.M)
    assert workdir == ["/src/examples/invoices"]
    assert (ROOT / "examples" / "invoices" / "tasks.py").is_file()
