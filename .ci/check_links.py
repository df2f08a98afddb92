"""Find dead internal links in the built documentation site and in the README. No network.

    python .ci/check_links.py SITE_DIR [README.md]

- Every ``href`` and ``src`` of every page of SITE_DIR that stays inside the site must name a file
  the build wrote (a directory means its ``index.html``), and its ``#fragment`` an ``id`` on that
  page.
- The README is shown on the package index, where relative links are dead: every link in it must
  be absolute or a ``#fragment`` of the README itself. Links to the documentation site (the
  ``Documentation`` URL of pyproject.toml) are checked against SITE_DIR, fragment included;
  links to a file of this repository on GitHub (``.../blob/main/PATH``, ``.../tree/main/PATH``)
  against the checkout.

Exit status 0 iff nothing is dead; each dead link is printed as ``where: link (why)``.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

ROOT = Path(__file__).resolve().parents[1]
_MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|<a\s[^>]*href=\"([^\"]+)\"")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


class _Page(HTMLParser):
    """The links and the ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            elif name in ("href", "src") and not (
                tag == "link" and name == "href" and "canonical" in str(attrs)
            ):
                self.links.append(value)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(errors="replace"))
    return page


class Site:
    def __init__(self, root: Path, prefix: str = "/") -> None:
        self.root = root.resolve()
        self.prefix = prefix  # where the site is served: its root-relative links start so
        self._pages: dict[Path, _Page] = {}

    def page(self, path: Path) -> _Page:
        if path not in self._pages:
            self._pages[path] = _parse(path)
        return self._pages[path]

    def target(self, path: Path) -> Path | None:
        """The file a link to ``path`` serves, or None."""
        if path.is_dir():
            path = path / "index.html"
        return path if path.is_file() else None

    def check(self, where: str, base: Path, link: str) -> str | None:
        """Why the site-internal ``link``, found in a page whose folder is ``base``, is dead."""
        url, fragment = urldefrag(link)
        path = unquote(urlsplit(url).path)
        if not path:
            target: Path | None = base / "index.html" if (base / "index.html").is_file() else None
        elif path.startswith("/"):
            if not path.startswith(self.prefix):
                return f"outside the site's path {self.prefix}"
            target = self.target(self.root / path[len(self.prefix) :])
        else:
            target = self.target((base / path).resolve())
        if target is None:
            return "no such page or file"
        if not target.resolve().is_relative_to(self.root):
            return "points outside the site"
        if fragment and target.suffix == ".html" and unquote(fragment) not in self.page(target).ids:
            return f"no anchor #{fragment} on {target.relative_to(self.root)}"
        return None


def _internal(link: str) -> bool:
    parts = urlsplit(link)
    return not (parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")))


def check_site(site: Site) -> list[str]:
    dead = []
    for html in sorted(site.root.rglob("*.html")):
        base = html.parent
        for link in site.page(html).links:
            if not _internal(link):
                continue
            why = site.check(str(html.relative_to(site.root)), base, link)
            if why:
                dead.append(f"{html.relative_to(site.root)}: {link} ({why})")
    return dead


def _slug(heading: str) -> str:
    """GitHub's anchor for a README heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def readme_links(text: str) -> list[str]:
    prose = _CODE.sub("", text)
    return [m.group(1) or m.group(2) for m in _MD_LINK.finditer(prose)]


def _project_url(name: str) -> str:
    """``name``'s URL in pyproject.toml's [project.urls] (read by pattern: tomllib is 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'^{name}\s*=\s*"([^"]+)"', text.split("[project.urls]", 1)[1], flags=re.M)
    if match is None:
        raise SystemExit(f"pyproject.toml has no {name} in [project.urls]")
    return match.group(1).rstrip("/") + "/"


def documentation_url() -> str:
    return _project_url("Documentation")


def site_prefix() -> str:
    """The path the site is served under, from mkdocs.yml's ``site_url``."""
    match = re.search(r"^site_url:\s*(\S+)", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    path = urlsplit(match.group(1)).path if match else "/"
    return path.rstrip("/") + "/"


def repository_url() -> str:
    return _project_url("Homepage")


def check_readme(readme: Path, site: Site | None) -> list[str]:
    text = readme.read_text()
    anchors = {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}
    docs, repo = documentation_url(), repository_url()
    dead = []
    for link in readme_links(text):
        if link.startswith("#"):
            if link[1:] not in anchors:
                dead.append(f"README.md: {link} (no such heading)")
        elif not urlsplit(link).scheme:
            dead.append(f"README.md: {link} (relative: dead on the package index; make it absolute)")
        elif link.startswith(docs) and site is not None:
            why = site.check("README.md", site.root, link[len(docs) :] or "./")
            if why:
                dead.append(f"README.md: {link} ({why})")
        elif link.startswith(repo):
            match = re.match(r"(?:blob|tree)/main/(.*)", urldefrag(link)[0][len(repo) :])
            if match and not (ROOT / unquote(match.group(1))).exists():
                dead.append(f"README.md: {link} (no such file in the repository)")
    return dead


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__, file=sys.stderr)
        return 2
    site = Site(Path(argv[0]), site_prefix())
    dead = check_site(site)
    if len(argv) == 2:
        dead += check_readme(Path(argv[1]), site)
    for line in dead:
        print(line)
    pages = sum(1 for _ in site.root.rglob("*.html"))
    print(f"checked {pages} pages{' and the README' if len(argv) == 2 else ''}: {len(dead)} dead links")
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
