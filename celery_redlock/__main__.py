"""The ``celery-redlock`` command (also ``python -m celery_redlock``): the operators' commands
over masters given by ``--masters`` or ``CELERY_REDLOCK_MASTERS`` (:mod:`celery_redlock.ops`,
the same commands as ``celery -A proj redlock``), and the ``demo``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from .demo.command import demo
from .ops.standalone import group


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); its exit status."""
    # A force-release's WARNING (celery_redlock.admin) is the audit line an operator expects to
    # see, with its level and logger; an embedding program's own logging is left alone.
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    command = group()
    command.add_command(demo)
    try:
        command.main(args=list(argv) if argv is not None else None, prog_name="celery-redlock")
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
