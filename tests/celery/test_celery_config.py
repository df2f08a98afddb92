"""Configuration (issue #14 item 7): a bad setting stops a real worker before it is ready, an
unknown ``redlock_*`` name is an error naming the closest known one, a change to ``app.conf``
after first use is picked up by the next locked run, and ``config_from_object`` namespaces
(Django's ``CELERY_REDLOCK_...``) work. Real servers throughout; eager ``apply()`` runs where a
worker process is not the point."""

from __future__ import annotations

import logging
import re
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from conftest import wait_until

from celery_redlock import ConfigError, Redlock, RedlockTask
from celery_redlock.celery.settings import (
    KNOWN_SETTINGS,
    app_settings_and_redlock,
    close_app_redlock,
    unknown_settings,
)
from celery_redlock.celery.task import check_app
from celery_redlock.testing import CeleryWorker, RedisServer, ServerSet

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_redlock"
NOWHERE = "redis://127.0.0.1:1/0"  # constructing a Redlock sends nothing: nobody need listen

# -- helpers -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_masters() -> Iterator[ServerSet]:
    """A second, separate set of three masters, to switch an app's ``redlock_masters`` to."""
    with ServerSet(3) as servers:
        yield servers


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery(f"cfg-{uuid.uuid4().hex[:8]}", set_as_current=False)
    yield app
    close_app_redlock(app)


Holders = Callable[[list[str], str], int]


@pytest.fixture
def holders() -> Iterator[Holders]:
    """How many masters of a set hold a key (by any token): one Redlock per set, closed after."""
    counters: dict[tuple[str, ...], Redlock] = {}
    mutex = threading.Lock()  # the probe's body and the test may count at once

    def count(urls: list[str], key: str) -> int:
        with mutex:
            counter = counters.get(tuple(urls))
            if counter is None:
                # A count of what every master holds: a late reply must not read as "not held".
                counter = counters[tuple(urls)] = Redlock(urls, request_timeout=1.0)
        return counter.holders(key)

    yield count
    for counter in counters.values():
        counter.close()


def define_probe(app: Celery, holders: Holders, gate: threading.Event | None = None) -> Any:
    """A locked task whose body returns what its lock is: key, TTL and how many masters of
    each set hold the key right now. With ``gate``, the body waits for it before returning."""

    @app.task(
        bind=True,
        base=RedlockTask,
        lock_key="cfg:<key>",
        name=f"{app.main}.probe",
        lazy=False,
        shared=False,  # each test's app has its own: no other app of the session may inherit it
    )
    def probe(self: RedlockTask, key: str, sets: dict[str, list[str]]) -> dict[str, Any]:
        lock = self.redlock
        if gate is not None:
            assert gate.wait(20), "the test never opened the gate"
        held = {label: holders(urls, lock.key) for label, urls in sets.items()}
        return {"key": lock.key, "ttl": lock.ttl, "held": held}

    return probe


# -- worker start: a bad setting stops it, an unknown one is warned about ---------------------------

# The app a worker subprocess runs, configured the Django way: one settings object whose
# CELERY_-prefixed names are Celery's (config_from_object with namespace="CELERY"), the masters
# as the comma-separated string an environment variable gives.
WORKER_APP = """
import os

from celery import Celery

from celery_redlock import RedlockTask


class Settings:
    CELERY_BROKER_URL = os.environ["CFG_BROKER"]
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
{settings}


app = Celery("{name}")
app.config_from_object(Settings, namespace="CELERY")
app.conf.result_backend = os.environ["CFG_BROKER"]


@app.task(base=RedlockTask, lock_key="cfg:<n>", name="{name}.job"{options})
def job(n):
    return n
"""


def worker_for(
    tmp_path: Path, broker_url: str, masters: list[str], settings: str, options: str = ""
) -> CeleryWorker:
    name = f"cfgapp_{uuid.uuid4().hex[:8]}"
    body = textwrap.indent(textwrap.dedent(settings).strip(), "    ")
    (tmp_path / f"{name}.py").write_text(WORKER_APP.format(name=name, settings=body, options=options))
    return CeleryWorker(
        name,
        pool="prefork",
        concurrency=2,
        queues=[f"q-{name}"],
        env={"CFG_BROKER": broker_url, "CFG_MASTERS": ",".join(masters)},
        pythonpath=[str(tmp_path), str(ROOT)],
        log_dir=tmp_path,
    )


MASTERS_FROM_ENV = 'CELERY_REDLOCK_MASTERS = os.environ["CFG_MASTERS"]'


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("settings", "options", "says"),
    [
        pytest.param(
            f"{MASTERS_FROM_ENV}\nCELERY_REDLOCK_TTL = -1", "", r"redlock_ttl must be > 0", id="ttl=-1"
        ),
        pytest.param(
            f'{MASTERS_FROM_ENV}\nCELERY_REDLOCK_TTL = float("nan")',
            "",
            r"redlock_ttl must be a finite number",
            id="ttl=nan",
        ),
        # Valid on its own, but below what a round over the default request_timeout can honour:
        # refused by the Redlock at every acquire, so at start too.
        pytest.param(
            MASTERS_FROM_ENV, ", lock_ttl=0.05", r"\.job': lock_ttl must be at least", id="lock_ttl"
        ),
        # Above what a round can honour, but too short for any heartbeat interval to keep alive.
        pytest.param(
            MASTERS_FROM_ENV,
            ", lock_ttl=0.12",
            r"\.job': lock_ttl 0\.12 s is too short to be kept alive",
            id="lock_ttl-unkeepable",
        ),
        # A misspelt setting stops it, with the right name.
        pytest.param(
            'CELERY_REDLOCK_MASTER = os.environ["CFG_MASTERS"]',
            "",
            r"'CELERY_REDLOCK_MASTER' is not a celery-redlock setting; did you mean "
            r"'CELERY_REDLOCK_MASTERS'\?",
            id="misspelt-masters",
        ),
        pytest.param(
            f"{MASTERS_FROM_ENV}\nCELERY_REDLOCK_TLL = 5.0",
            "",
            r"'CELERY_REDLOCK_TLL' is not a celery-redlock setting; did you mean 'CELERY_REDLOCK_TTL'\?",
            id="misspelt-ttl",
        ),
    ],
)
def test_a_bad_setting_stops_the_worker_before_it_is_ready(
    tmp_path: Path,
    broker: RedisServer,
    redlock_master_urls: list[str],
    settings: str,
    options: str,
    says: str,
) -> None:
    worker = worker_for(tmp_path, broker.url, redlock_master_urls, settings, options)
    started = time.monotonic()
    worker.start(wait=False)
    try:
        # Bounded: the check runs before the pool and the consumer exist, so nothing can hang.
        wait_until(lambda: not worker.running, 60, "the worker to exit")
        took = time.monotonic() - started
        code, log = worker.returncode, worker.log_text()
    finally:
        worker.stop()
    assert code != 0, log
    assert re.search(says, log), log
    assert "celery-redlock: the worker cannot start" in log
    assert " ready." not in log
    assert took < 45, f"the worker took {took:.1f} s to stop"


@pytest.mark.timeout(90)
def test_namespaced_settings_work_and_other_names_are_not_ours(
    tmp_path: Path, broker: RedisServer, redlock_master_urls: list[str]
) -> None:
    worker = worker_for(
        tmp_path,
        broker.url,
        redlock_master_urls,
        f"{MASTERS_FROM_ENV}\nCELERY_REDLOCK_TTL = 5.0\n"
        "REDLOCK_URL = 'a setting of the project, not of Celery: never judged'",
    )
    worker.start()
    try:
        assert "REDLOCK_URL" not in worker.log_text()
        # The worker locks on the namespaced masters, given as one comma-separated string.
        client = Celery("client", broker=broker.url, backend=broker.url, set_as_current=False)
        job = f"{worker.app_module}.job"
        assert client.send_task(job, args=(7,), queue=worker.queues[0]).get(timeout=30) == 7
    finally:
        worker.stop()


# -- check_app: what every run would refuse is refused at start -------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("settings", "options", "says"),
    [
        ({"redlock_ttl": -1}, {}, "redlock_ttl must be > 0"),
        ({"redlock_request_timeout": float("inf")}, {}, "redlock_request_timeout must be a finite"),
        ({"redlock_masters": [NOWHERE, NOWHERE]}, {}, "redlock_masters: .* is listed more than once"),
        ({"redlock_masters": ["redis://127.0.0.1:1/0", "redis://localhost:1/1"]}, {}, "are one server"),
        ({"redlock_ttl": 0.05}, {}, "redlock_ttl must be at least"),
        ({}, {"lock_ttl": 0.05}, "'checked.job': lock_ttl must be at least"),
        ({}, {"lock_slot": True}, "'checked.job': lock_slot=True takes the period"),
        (
            {"redlock_heartbeat_interval": 10.0},
            {"lock_ttl": 5.0},
            "redlock_heartbeat_interval 10 s cannot keep its lock alive.*largest heartbeat "
            "interval allowed is 4.75 s",
        ),
    ],
)
def test_check_app_refuses_what_every_locked_run_would(
    app: Celery, settings: dict[str, Any], options: dict[str, Any], says: str
) -> None:
    app.conf.redlock_masters = [NOWHERE]
    app.conf.update(settings)

    @app.task(base=RedlockTask, lock_key="x:<n>", name="checked.job", lazy=False, shared=False, **options)
    def job(n: int) -> int:
        return n

    with pytest.raises(ConfigError, match=says):
        check_app(app)


# -- unknown names ----------------------------------------------------------------------------------


def namespaced(source: dict[str, Any]) -> Any:
    app = Celery("names", set_as_current=False)
    app.config_from_object(source, namespace="CELERY")
    return app.conf


@pytest.mark.timeout(30)
def test_unknown_names_get_the_closest_known_one_in_the_style_they_were_written() -> None:
    conf = namespaced(
        {
            "CELERY_REDLOCK_TLL": 1,
            "CELERY_REDLOCK_TTL": 1,  # read: not warned about
            "celery_redlock_ttl": 1,  # the prefix is upper-case, so Celery reads only CELERY_REDLOCK_TTL
            "CELERY_REDLOCK_BEAT_LOCK_TTL": 10,  # the beat's: known
            "CELERY_REDLOCK_COMPLETELY_OTHER": 1,
            "REDLOCK_URL": "somebody else's",  # outside the namespace: not ours to judge
        }
    )
    conf.redlock_contnded = "skip"  # lower-case, through app.conf: Celery reads these too
    messages = sorted(unknown_settings(conf))
    assert messages == [
        "'CELERY_REDLOCK_COMPLETELY_OTHER' is not a celery-redlock setting (docs/settings.md lists them)",
        "'CELERY_REDLOCK_TLL' is not a celery-redlock setting; did you mean 'CELERY_REDLOCK_TTL'?",
        "'celery_redlock_ttl' is not a celery-redlock setting; did you mean 'CELERY_REDLOCK_TTL'?",
        "'redlock_contnded' is not a celery-redlock setting; did you mean 'redlock_contended'?",
    ]
    # Without a namespace, Celery reads only the lower-case names. A deprecated setting
    # (redlock_release_linger: check_app warns that it does nothing) is still a known one.
    plain = Celery("plain", set_as_current=False).conf
    plain.update(REDLOCK_TTL=1, redlock_release_linger=0, redlock_tll=1)
    assert sorted(unknown_settings(plain)) == [
        "'REDLOCK_TTL' is not a celery-redlock setting; did you mean 'redlock_ttl'?",
        "'redlock_tll' is not a celery-redlock setting; did you mean 'redlock_ttl'?",
    ]


@pytest.mark.timeout(30)
def test_an_unknown_setting_fails_every_run_naming_it(
    app: Celery, holders: Holders, redlock_master_urls: list[str]
) -> None:
    app.conf.redlock_masters = redlock_master_urls
    app.conf.redlock_tll = 5.0
    probe = define_probe(app, holders)
    said = r"'redlock_tll' is not a celery-redlock setting; did you mean 'redlock_ttl'\?"
    with pytest.raises(ConfigError, match=said):
        probe.apply(("first", {})).get(timeout=10)
    # Corrected (the typo removed from the conf's changes), the next run locks with the setting.
    app.conf.changes.pop("redlock_tll")
    app.conf.redlock_ttl = 5.0
    assert probe.apply(("second", {})).get(timeout=10)["ttl"] == 5.0


@pytest.mark.timeout(30)
def test_every_setting_the_package_reads_is_known() -> None:
    # Whoever adds a setting adds it to DEFAULTS or BEAT_SETTINGS, or its users are told it is
    # unknown. Reads are conf.get("redlock_..."), conf["redlock_..."] or conf.redlock_...
    read = re.compile(r"""conf(?:\.get\(\s*|\[)["'](redlock_[a-z][a-z_]*)["']|conf\.(redlock_[a-z][a-z_]*)""")
    names = {
        next(filter(None, match.groups()))
        for path in PACKAGE.rglob("*.py")
        for match in read.finditer(path.read_text())
    }
    assert "redlock_beat_lock_ttl" in names and "redlock_masters" in names  # the scan finds reads
    assert names - KNOWN_SETTINGS == set()


# -- a change after first use is picked up ---------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_readme_recipe_switching_masters_between_tests_is_picked_up(
    app: Celery, holders: Holders, redlock_masters: ServerSet, other_masters: ServerSet
) -> None:
    first, second = list(redlock_masters.urls), list(other_masters.urls)
    sets = {"first": first, "second": second}
    probe = define_probe(app, holders)
    # As the README's "Testing your own app" does, once per test: set the masters, run.
    app.conf.redlock_masters = first
    assert probe.apply(("a", sets)).get(timeout=10)["held"] == {"first": 5, "second": 0}
    app.conf.redlock_masters = second
    assert probe.apply(("b", sets)).get(timeout=10)["held"] == {"first": 0, "second": 3}
    # An append to the list set before is a change too.
    partial = first[:3]
    app.conf.redlock_masters = partial
    assert probe.apply(("c", sets)).get(timeout=10)["held"] == {"first": 3, "second": 0}
    partial.extend(first[3:])
    assert probe.apply(("d", sets)).get(timeout=10)["held"] == {"first": 5, "second": 0}
    # So is a namespace given later by config_from_object (a new app.conf altogether).
    app.config_from_object({"CELERY_REDLOCK_MASTERS": ",".join(second)}, namespace="CELERY")
    assert probe.apply(("e", sets)).get(timeout=10)["held"] == {"first": 0, "second": 3}


@pytest.mark.timeout(60)
def test_a_lock_held_across_a_change_is_released_on_the_masters_that_granted_it(
    app: Celery, holders: Holders, redlock_masters: ServerSet, other_masters: ServerSet
) -> None:
    first, second = list(redlock_masters.urls), list(other_masters.urls)
    app.conf.redlock_masters = first
    gate = threading.Event()
    probe = define_probe(app, holders, gate)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.append(probe.apply(("held", {}))), daemon=True)
    runner.start()
    try:
        # Held means held on a quorum of the five: a master a loaded host made answer late had its
        # grant retracted, and waiting for all five would then wait forever.
        wait_until(lambda: holders(first, "redlock:cfg:held") >= 3, 10, "the first run to hold its lock")
        _, before = app_settings_and_redlock(app)
        app.conf.redlock_masters = second
        app.conf.redlock_ttl = 7.5
        gate.set()  # the next run passes straight through
        other = probe.apply(("other", {"first": first, "second": second})).get(timeout=10)
        assert other["held"] == {"first": 0, "second": 3} and other["ttl"] == 7.5
        _, after = app_settings_and_redlock(app)
        assert after is not before
        runner.join(20)
        assert results and results[0].state == "SUCCESS", results
        # The first run's release went to the masters that granted it, and a quorum answered it
        # before its result was stored (what release() waits for); the rest apply it soon after.
        assert holders(first, "redlock:cfg:held") <= 2
        wait_until(lambda: holders(first, "redlock:cfg:held") == 0, 5, "the release on every master")
        assert holders(second, "redlock:cfg:held") == 0
    finally:
        gate.set()
        runner.join(20)


@pytest.mark.timeout(60)
def test_a_change_of_a_policy_or_ttl_is_seen_by_the_next_run(
    app: Celery, holders: Holders, redlock_master_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_redlock.settings")
    app.conf.redlock_masters = redlock_master_urls
    app.conf.redlock_contended = "fail"
    probe = define_probe(app, holders)
    assert probe.apply(("p", {})).get(timeout=10)["ttl"] == 30.0
    settings, redlock = app_settings_and_redlock(app)
    assert probe.lock_options(settings).contended == "fail"
    app.conf.redlock_contended = "skip"
    app.conf["redlock_ttl"] = 12.0
    assert probe.apply(("p", {})).get(timeout=10)["ttl"] == 12.0
    changed, rebuilt = app_settings_and_redlock(app)
    assert probe.lock_options(changed).contended == "skip"
    assert rebuilt is not redlock  # the TTL is the Redlock's default: a new one
    app.conf.update(redlock_max_retries=4)  # a policy only: the Redlock stays
    assert probe.lock_options(app_settings_and_redlock(app)[0]).max_retries == 4
    assert app_settings_and_redlock(app)[1] is rebuilt
    del app.conf["redlock_ttl"]  # back to the default
    assert probe.apply(("p", {})).get(timeout=10)["ttl"] == 30.0
    described = [r.getMessage() for r in caplog.records if "changed after first use" in r.getMessage()]
    assert any(
        "redlock_contended 'fail' -> 'skip'" in m and "redlock_ttl 30.0 -> 12.0" in m for m in described
    )


@pytest.mark.timeout(30)
def test_the_apps_time_limit_is_read_with_the_settings_and_its_change_seen(
    app: Celery, redlock_master_urls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Celery's ``task_time_limit`` caps a prefork child's heartbeat (task._redlock_max_hold). It
    is read with our settings, not looked up in ``app.conf`` by every run, so a change to it
    must make the next run read the settings again, as a change of ours does; the Redlock
    stays, and the log line names Celery's setting as it is spelt."""
    caplog.set_level(logging.INFO, logger="celery_redlock.settings")
    app.conf.redlock_masters = redlock_master_urls
    settings, redlock = app_settings_and_redlock(app)
    assert settings.task_time_limit is None
    app.conf.task_time_limit = 7
    changed, same = app_settings_and_redlock(app)
    assert changed.task_time_limit == 7
    assert same is redlock
    assert any("task_time_limit None -> 7" in r.getMessage() for r in caplog.records)
    assert not any("redlock_task_time_limit" in r.getMessage() for r in caplog.records)
    app.conf.update(task_time_limit=9)
    assert app_settings_and_redlock(app)[0].task_time_limit == 9
    del app.conf["task_time_limit"]
    assert app_settings_and_redlock(app)[0].task_time_limit is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("source", "namespace", "changed_key"),
    [
        ({"CELERY_TASK_TIME_LIMIT": 11}, "CELERY", "CELERY_TASK_TIME_LIMIT"),
        ({"CELERYD_TASK_TIME_LIMIT": 11, "BROKER_URL": "memory://"}, None, "CELERYD_TASK_TIME_LIMIT"),
        ({"task_time_limit": 11}, None, "task_time_limit"),
    ],
    ids=["django-namespace", "old-style", "config-object"],
)
def test_the_apps_time_limit_is_read_as_celery_reads_it_in_every_style(
    redlock_master_urls: list[str], source: dict[str, Any], namespace: str | None, changed_key: str
) -> None:
    """Whatever name the app's configuration gives the time limit (a Django settings module's
    ``CELERY_TASK_TIME_LIMIT``, the old ``CELERYD_TASK_TIME_LIMIT``, a configuration object),
    the settings carry what ``app.conf.task_time_limit`` says, before and after a change to that
    very key, and after a configuration object given after first use."""
    app = Celery(f"limits-{uuid.uuid4().hex[:8]}", set_as_current=False)
    masters_key = "CELERY_REDLOCK_MASTERS" if namespace else "redlock_masters"
    app.config_from_object({masters_key: redlock_master_urls, **source}, namespace=namespace)
    try:
        assert app_settings_and_redlock(app)[0].task_time_limit == app.conf.task_time_limit == 11
        app.conf[changed_key] = 12
        assert app_settings_and_redlock(app)[0].task_time_limit == app.conf.task_time_limit == 12
        app.config_from_object({masters_key: redlock_master_urls, **source}, namespace=namespace)
        assert app_settings_and_redlock(app)[0].task_time_limit == app.conf.task_time_limit == 11
    finally:
        close_app_redlock(app)


@pytest.mark.timeout(30)
def test_a_bad_change_fails_every_run_naming_the_setting_until_it_is_corrected(
    app: Celery, holders: Holders, redlock_master_urls: list[str]
) -> None:
    app.conf.redlock_masters = redlock_master_urls
    probe = define_probe(app, holders)
    assert probe.apply(("bad", {})).state == "SUCCESS"
    app.conf.redlock_ttl = -1
    for _ in range(2):  # never the settings read before, for as long as the value is bad
        result = probe.apply(("bad", {}))
        assert result.state == "FAILURE"
        assert isinstance(result.result, ConfigError)
        assert "redlock_ttl must be > 0" in str(result.result)
    app.conf.redlock_ttl = 9.0
    assert probe.apply(("bad", {})).get(timeout=10)["ttl"] == 9.0


# -- namespaces: config_from_object the way Celery (and Django) users do it -------------------------


@pytest.mark.timeout(30)
def test_a_django_style_settings_module_with_the_celery_namespace(
    app: Celery,
    holders: Holders,
    redlock_master_urls: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_redlock.settings")
    module = f"cfg_django_settings_{uuid.uuid4().hex[:8]}"
    # As a Django project's settings.py reads: upper-case names, the masters from the environment.
    monkeypatch.setenv("REDLOCK_MASTERS", ",".join(redlock_master_urls))
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            import os

            DEBUG = False
            REDLOCK_URL = "a setting of the project's own"
            CELERY_REDLOCK_MASTERS = os.environ["REDLOCK_MASTERS"]
            CELERY_REDLOCK_TTL = 8.0
            CELERY_REDLOCK_KEY_PREFIX = "django:"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    app.config_from_object(module, namespace="CELERY")
    probe = define_probe(app, holders)
    run = probe.apply(("dj", {"masters": redlock_master_urls})).get(timeout=10)
    assert run == {"key": "django:cfg:dj", "ttl": 8.0, "held": {"masters": 5}}
    assert [r for r in caplog.records if r.name == "celery_redlock.settings"] == []
