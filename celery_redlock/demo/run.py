"""``python -m celery_redlock demo``: the main job, end to end, on real processes.

Starts five lock masters and a broker (embedded servers, unless real ones are given), two or more
real ``celery worker`` processes, and submits a burst of ``charge_invoice(invoice_id)`` calls in
which most invoices appear many times. Half-way through it kills one master. A checker reads what
every worker process recorded and looks for two holds of the same invoice that overlap in time.
Exit status 0 iff none did and every task finished; 130 when interrupted.

Every process it starts is stopped by pid (and process group) on the way out, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..testing.celery import CeleryWorker
from ..testing.servers import RedisServer, ServerSet
from .ledger import LedgerReader, Summary, summarize

POLL = 0.1
EXIT_INTERRUPTED = 130


@dataclass
class DemoOptions:
    masters: list[str] | None = None
    broker: str | None = None
    workers: int = 2
    concurrency: int = 2
    tasks: int = 300
    invoices: int = 30
    work: float = 0.05
    contended: str = "retry"
    kill_master: bool = True
    deadline: float = 45.0
    seed: int | None = None


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: clean up and leave."""


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # Only the first signal unwinds: a second Ctrl-C must not cut the cleanup short.
    for other in (signal.SIGINT, signal.SIGTERM):
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM both unwind the stack, so every cleanup below runs."""
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def burst(tasks: int, invoices: int, rng: random.Random) -> list[int]:
    """``tasks`` invoice ids over ``invoices`` invoices, each at least once.

    Duplicates arrive as they do in life: a few copies of one call close together (a double
    click, a redelivery, a retrying client), with such clusters of all invoices shuffled.
    """
    ids = [i % invoices + 1 for i in range(tasks)]
    clusters: list[list[int]] = []
    for invoice in range(1, invoices + 1):
        copies = ids.count(invoice)
        while copies:
            size = min(copies, rng.randint(1, 4))
            clusters.append([invoice] * size)
            copies -= size
    rng.shuffle(clusters)
    return [invoice for cluster in clusters for invoice in cluster]


def summary_table(summary: Summary, *, wall: float, total: float, killed: str) -> Table:
    table = Table(title="celery-redlock demo", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    overlaps = len(summary.overlaps)
    rows = [
        ("tasks submitted", str(summary.submitted)),
        ("tasks finished", str(summary.finished)),
        ("bodies run", str(summary.ran)),
        ("duplicates that waited (retried)", str(summary.waited)),
        ("duplicates skipped", str(summary.skipped)),
        ("tasks failed", str(summary.failed)),
        ("overlaps found by the checker", f"[{'green' if not overlaps else 'bold red'}]{overlaps}[/]"),
        ("lock acquire latency p50", f"{summary.acquire_p50 * 1000:.1f} ms"),
        ("lock acquire latency p99", f"{summary.acquire_p99 * 1000:.1f} ms"),
        ("master killed mid-burst", killed),
        ("burst wall time", f"{wall:.2f} s"),
        ("demo wall time (with start-up)", f"{total:.2f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def run_demo(options: DemoOptions, console: Console) -> int:
    began = time.monotonic()
    rng = random.Random(options.seed)
    with contextlib.ExitStack() as stack:
        masters, master_urls, broker_url = _servers(options, stack, console)
        ledger_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="redlock-demo-")))
        env = {
            "CELERY_REDLOCK_DEMO_BROKER": broker_url,
            "CELERY_REDLOCK_DEMO_MASTERS": ",".join(master_urls),
            "CELERY_REDLOCK_DEMO_LEDGER": str(ledger_dir),
            "CELERY_REDLOCK_DEMO_WORK": str(options.work),
            "CELERY_REDLOCK_DEMO_CONTENDED": options.contended,
        }
        os.environ.update(env)  # the producer below imports the same app module
        workers = [
            CeleryWorker(
                "celery_redlock.demo.tasks",
                concurrency=options.concurrency,
                env=env,
                log_dir=ledger_dir / "logs",
                cwd=ledger_dir,
                name=f"worker{n + 1}",
            )
            for n in range(options.workers)
        ]
        for worker in workers:
            stack.callback(worker.stop)
            worker.start(wait=False)
            console.print(f"worker {worker.name} pid {worker.pid}")
        for worker in workers:
            worker.wait_ready()
        console.print(f"{len(workers)} workers ready (prefork, concurrency {options.concurrency})")

        from . import tasks as demo_tasks

        ids = burst(options.tasks, options.invoices, rng)
        reader = LedgerReader(ledger_dir)
        started = time.monotonic()
        with demo_tasks.app.producer_or_acquire() as producer:
            for invoice_id in ids:
                demo_tasks.charge_invoice.apply_async((invoice_id,), producer=producer)
        console.print(f"submitted {len(ids)} charge_invoice calls over {options.invoices} invoices")
        killed = _watch(reader, len(ids), started + options.deadline, options, masters, rng, console)
        wall = time.monotonic() - started

        for worker in workers:
            worker.stop()
        reader.poll()
        summary = summarize(reader, len(ids))
        console.print(summary_table(summary, wall=wall, total=time.monotonic() - began, killed=killed))
        for first, second in summary.overlaps[:10]:
            console.print(
                f"[red]overlap on {first.resource}: pid {first.pid} held it "
                f"{first.start:.3f}-{first.end:.3f}, pid {second.pid} from {second.start:.3f}"
            )
        if summary.finished < summary.submitted:
            console.print(
                f"[red]{summary.submitted - summary.finished} tasks did not finish within "
                f"{options.deadline:.0f} s; worker logs were in {ledger_dir / 'logs'}"
            )
            for worker in workers:
                console.print(worker.log_tail(1500), markup=False)
        return 0 if summary.ok else 1


def _servers(
    options: DemoOptions, stack: contextlib.ExitStack, console: Console
) -> tuple[ServerSet | None, list[str], str]:
    """The masters' URLs and the broker's: the real servers given, or embedded ones started here
    and stopped with ``stack``. The embedded masters are returned too: one of them is killed."""
    masters: ServerSet | None = None
    if options.masters:
        master_urls = options.masters
    else:
        masters = stack.enter_context(ServerSet(5))
        master_urls = masters.urls
        for server in masters:
            console.print(f"master {server.address} pid {server.pid}")
    if options.broker:
        broker_url = options.broker
    else:
        broker = stack.enter_context(RedisServer())
        broker_url = broker.url
        console.print(f"broker {broker.address} pid {broker.pid}")
    return masters, master_urls, broker_url


def _watch(
    reader: LedgerReader,
    total: int,
    deadline: float,
    options: DemoOptions,
    masters: ServerSet | None,
    rng: random.Random,
    console: Console,
) -> str:
    """Show the burst's progress until all ``total`` tasks finished or ``deadline`` (monotonic)
    passed, killing a master half-way if asked; which master was killed ("no" if none)."""
    killed = "no"
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bar = progress.add_task("tasks finished", total=total)
        while reader.finished < total and time.monotonic() < deadline:
            time.sleep(POLL)
            reader.poll()
            progress.update(bar, completed=reader.finished)
            if options.kill_master and killed == "no" and reader.finished >= total // 2:
                killed = _kill_one(masters, rng, console)
    return killed


def _kill_one(masters: ServerSet | None, rng: random.Random, console: Console) -> str:
    if masters is None:
        console.print("real masters given: not killing one")
        return "no (real masters)"
    victim = masters[rng.randrange(len(masters))]
    pid = victim.pid
    victim.kill()
    console.print(
        f"[yellow]killed master {victim.address} (pid {pid}): "
        f"{len(masters) - 1} left, quorum is still {len(masters) // 2 + 1}"
    )
    return victim.address


def main(options: DemoOptions) -> int:
    """Run the demo with ``options`` (``celery-redlock demo``'s, :mod:`.command`); its exit status."""
    console = Console(highlight=False)
    with _signals_interrupt():
        try:
            return run_demo(options, console)
        except Interrupted as why:
            console.print(f"[yellow]interrupted ({why}): every process started was stopped")
            return EXIT_INTERRUPTED
