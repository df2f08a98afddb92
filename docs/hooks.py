"""mkdocs hooks (mkdocs.yml ``hooks:``): the docstrings the API reference renders are written for
Sphinx-style roles (``:class:`Lock```); show their targets as plain code."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|mod|attr|data|func|exc|obj):\s*(?=<code)")
_TILDE = re.compile(r"<code>~")


def on_page_content(html: str, **_: Any) -> str:
    return _TILDE.sub("<code>", _ROLE.sub("", html))
