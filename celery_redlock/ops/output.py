"""Where the operators' commands write: the only writer of this package (the library itself
logs, it never prints).

Human output goes to stdout and warnings to stderr. With ``--json`` stdout carries exactly one
JSON document, so ``| jq`` always parses; everything else (progress, the confirmation prompt)
goes to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from ..lock.transport.master import RETRIED, STILL_TRYING

# What a master's failure reason says for a process that goes on (its connect is retried, a later
# round may use it): a command that ends after one round leaves it out.
_GOES_ON = (RETRIED, STILL_TRYING)


def one_shot(data: Any) -> Any:
    """``data`` (a line, or a document's values) as this one-shot command reports it."""
    if isinstance(data, str):
        for words in _GOES_ON:
            data = data.replace(words, "")
        return data
    if isinstance(data, dict):
        return {key: one_shot(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [one_shot(value) for value in data]
    return data


class Output:
    """One command's writer; ``as_json`` chooses the JSON document over the human lines."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def line(self, text: str = "") -> None:
        """A line of the human output (stderr under ``--json``: stdout is the document's)."""
        click.echo(one_shot(text), err=self.as_json)

    def warn(self, text: str) -> None:
        click.echo(f"warning: {one_shot(text)}", err=True)

    def fail(self, text: str) -> None:
        """Why the command did not do what was asked (stderr, as a usage error's message)."""
        click.echo(one_shot(text), err=True)

    def document(self, data: Any) -> None:
        """The ``--json`` answer; written only under ``--json``."""
        if self.as_json:
            click.echo(json.dumps(one_shot(data)))

    def table(self, header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
        widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            cells = (str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
            self.line("  ".join(cells).rstrip())

    def confirm(self, question: str) -> bool:
        """Ask ``question``; False when declined. The prompt goes where the human output goes,
        and its line is ended even when the answer came from a pipe (which echoes nothing), so
        whatever is written next (a log line on stderr) starts on a line of its own. No answer
        at all (end of input: a script or cron job without ``--yes``; Ctrl-C) is a no, so the
        command still ends its own way (and ``--json`` still prints its document)."""
        try:
            answer = click.confirm(question, default=False, err=self.as_json)
        except click.Abort:
            answer = False
        if not sys.stdin.isatty():
            click.echo("", err=self.as_json)
        return answer
