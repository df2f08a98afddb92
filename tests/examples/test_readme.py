"""Every code block in the README runs in a test, or says it is a fragment.

Each fenced block must follow a marker comment:

- ``<!-- test: exec -->``: a Python block, run here against five real masters
  (``REDLOCK_MASTERS`` is set to their URLs);
- ``<!-- test: excerpt PATH -->``: its lines appear, in order, in PATH (a file some other test
  runs); a line that is only ``...`` (with an optional comment) stands for the elided body;
- ``<!-- test: covered-by TEST ... -->``: the named test files run what the block shows: each
  command's script or module is named in one of them;
- ``<!-- fragment... -->``: not meant to run as it stands.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from celery_redlock.celery import beat, beatconf, settings
from celery_redlock.celery.task import RedlockTaskMixin

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(r"(?:<!--\s*(?P<marker>[^>]*?)\s*-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.S | re.M)
BLOCKS = [(m["marker"] or "", m["lang"], m["body"]) for m in BLOCK.finditer(README)]


def _blocks(kind: str) -> list[tuple[str, str, str]]:
    return [b for b in BLOCKS if b[0].startswith(kind)]


def test_every_block_is_tested_or_marked_as_a_fragment() -> None:
    assert len(BLOCKS) >= 5
    unmarked = [
        body[:60]
        for marker, _, body in BLOCKS
        if not marker.startswith(("test: exec", "test: excerpt", "test: covered-by", "fragment"))
    ]
    assert unmarked == []


def test_first_screen_is_the_two_fresh_machine_commands() -> None:
    _, lang, body = BLOCKS[0]
    assert lang == "bash"
    assert "python -m celery_redlock demo" in body.splitlines()[0]
    assert "python -m pytest" in body.splitlines()[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", range(len(_blocks("test: exec"))))
def test_exec_block_runs(index: int, redlock_master_urls: list[str]) -> None:
    _, lang, body = _blocks("test: exec")[index]
    assert lang == "python"
    result = subprocess.run(
        [sys.executable, "-c", body],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "REDLOCK_MASTERS": ",".join(redlock_master_urls)},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_excerpt_blocks_are_in_their_files() -> None:
    for marker, _, body in _blocks("test: excerpt"):
        source = (ROOT / marker.split()[2]).read_text().splitlines()
        position = 0
        for line in body.splitlines():
            if not line.strip() or re.fullmatch(r"\s*\.\.\.(\s*#.*)?", line):
                continue
            try:
                position = source.index(line, position) + 1
            except ValueError:
                pytest.fail(f"{marker}: line not found (in order): {line!r}")


def test_covered_blocks_name_what_their_tests_run() -> None:
    for marker, _, body in _blocks("test: covered-by"):
        tests = "".join((ROOT / path).read_text() for path in marker.split()[2:])
        for line in body.splitlines():
            for command in line.split("#")[0].split("&&"):
                args = command.split()
                if not args or args[:3] in (["python", "-m", "pip"], ["python", "-m", "pytest"]):
                    continue  # installing, and the suite itself
                assert args[0] == "python", command
                ran = f'"-m", "{args[2]}"' if args[1] == "-m" else args[1]
                assert ran in tests, f"{marker}: nothing runs {command.strip()!r}"


def test_settings_reference_lists_every_setting_and_task_option() -> None:
    names = set(settings.DEFAULTS)
    for module in (beat, beatconf):
        names |= set(re.findall(r"redlock_beat_\w+", inspect.getsource(module)))
    names |= {
        n
        for n in vars(RedlockTaskMixin)
        if n.startswith("lock_") and not callable(getattr(RedlockTaskMixin, n))
    }
    names.add("lock_key")
    reference = (ROOT / "docs" / "settings.md").read_text()
    missing = sorted(n for n in names if f"| `{n}` |" not in reference)
    assert missing == []


def test_placeholders_for_measured_figures_are_there() -> None:
    figures = (ROOT / "docs" / "benchmarks.md").read_text()
    for placeholder in ("<!-- BENCH_LOCK -->", "<!-- BENCH_CELERY -->", "<!-- FAULT_FIGURES -->"):
        assert placeholder in figures
