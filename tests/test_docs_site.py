"""The README is a front page and the docs are a site: what keeps them so.

- the README stays short, and every link in it works on the package index (absolute, or an
  anchor of the README itself), its documentation links under the ``Documentation`` URL;
- every page under docs/ is in the mkdocs nav, and every nav entry is a page;
- every module path the docs name exists (a design note must not point at code that moved).

The site itself is built, strictly, and its links checked by ``.ci/docs``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_links", ROOT / ".ci" / "check_links.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_links", module)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def _mkdocs() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return config


@pytest.mark.timeout(30)
def test_the_readme_is_at_most_200_lines() -> None:
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.timeout(30)
def test_every_readme_link_is_absolute_or_an_anchor() -> None:
    checker = _checker()
    links = checker.readme_links(README.read_text())
    assert len(links) >= 5
    relative = [link for link in links if not re.match(r"https?://|#", link)]
    assert relative == [], "the package index shows the README without the repository around it"


@pytest.mark.timeout(30)
def test_readme_documentation_links_use_the_documentation_url() -> None:
    checker = _checker()
    docs = checker.documentation_url()
    assert docs == _mkdocs()["site_url"]
    hosts = {
        re.match(r"https?://[^/]+/", link).group(0)  # type: ignore[union-attr]
        for link in checker.readme_links(README.read_text())
        if link.startswith("http")
    }
    # The docs site and the repository: nothing else, and one spelling of each.
    assert hosts <= {re.match(r"https?://[^/]+/", docs).group(0), "https://github.com/"}  # type: ignore[union-attr]


@pytest.mark.timeout(30)
def test_the_link_checker_finds_relative_links_and_missing_anchors(tmp_path: Path) -> None:
    checker = _checker()
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\n[a](docs/settings.md) [b](#title) [c](#nowhere) `[d](x.md)`\n")
    dead = checker.check_readme(readme, None)
    assert len(dead) == 2
    assert "docs/settings.md" in dead[0] and "relative" in dead[0]
    assert "#nowhere" in dead[1]


@pytest.mark.timeout(30)
def test_every_docs_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav = _nav_pages(_mkdocs()["nav"])
    pages = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == []
    assert sorted(set(nav) - set(pages)) == []
    assert len(nav) == len(set(nav))


@pytest.mark.timeout(30)
def test_the_module_paths_the_docs_name_exist() -> None:
    named = {
        match
        for path in [*DOCS.rglob("*.md"), README]
        for match in re.findall(r"\bcelery_redlock/[\w/]+\.py\b", path.read_text())
    }
    assert named, "the design notes name the modules they describe"
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert missing == []


@pytest.mark.timeout(30)
def test_no_design_note_says_it_is_not_built() -> None:
    for note in (DOCS / "design").glob("*.md"):
        text = note.read_text()
        assert "not implemented" not in text, note.name
        assert text.splitlines()[2].startswith("Status: implemented"), note.name


@pytest.mark.timeout(30)
def test_the_ha_beat_snippets_are_what_the_beat_tests_run() -> None:
    """docs/beat.md's settings for django-celery-beat and redbeat are lines of the files
    tests/beat/test_beat_django.py and tests/beat/test_beat_redbeat.py run beats with."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "beat.md").read_text(), flags=re.S)
    sources = {
        "CELERY_BEAT_SCHEDULER": ROOT / "tests" / "beat" / "django_settings.py",
        "beat_scheduler": ROOT / "tests" / "beat" / "redbeat_config.py",
    }
    checked = 0
    for block in blocks:
        for first, source in sources.items():
            if block.startswith(first):
                lines = source.read_text().splitlines()
                assert [line for line in block.splitlines() if line not in lines] == [], source.name
                checked += 1
    assert checked == 2
