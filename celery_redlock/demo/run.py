"""``python -m celery_redlock demo``: the main job, end to end, on real processes.

Starts five lock masters and a broker (embedded servers, unless real ones are given), two or more
real ``celery worker`` processes, and sends a burst of ``charge_invoice(invoice_id)`` calls over
a few seconds, in which every invoice is asked for many times: copies close together (a double
click, a retrying client) and again later. Most calls go through the task class, whose enqueue
deduplication hands a duplicate the queued call's task id; some are published by name, as
another service would, and meet only the lock. Half-way through it kills one master.

The verdict comes from what every process recorded (:mod:`.ledger`): each invoice charged
exactly once; each call ended one way (charged it; deduplicated at enqueue; skipped while
another call of its invoice held the lock; found it already charged); and no two holds of one
invoice overlapped in time. Exit status 0 iff all three hold; 130 when interrupted.

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
from itertools import groupby
from pathlib import Path
from types import FrameType
from typing import Any

from celery.utils import uuid
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..testing.celery import CeleryWorker
from ..testing.servers import RedisServer, ServerSet
from .ledger import (
    ALREADY,
    CHARGED,
    DEDUPLICATED,
    LOST,
    SKIPPED,
    LedgerReader,
    LedgerWriter,
    Summary,
    summarize,
)

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
    contended: str = "skip"
    spread: float = 3.0
    by_name: float = 0.2
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


APP = "app"
BY_NAME = "name"


@dataclass(frozen=True)
class Cluster:
    """Copies of one call sent back to back, through the task class (``app``) or by name."""

    invoice: int
    copies: int
    via: str = APP


def plan(tasks: int, invoices: int, rng: random.Random, by_name: float = 0.0) -> list[Cluster]:
    """``tasks`` calls over ``invoices`` invoices, each at least once, in clusters.

    Duplicates arrive as they do in life: a few copies of one call close together (a double
    click, a redelivery, a retrying client), with such clusters of all invoices shuffled; a
    ``by_name`` fraction of the clusters comes from a service that publishes by name.
    """
    ids = [i % invoices + 1 for i in range(tasks)]
    clusters: list[Cluster] = []
    for invoice in range(1, invoices + 1):
        copies = ids.count(invoice)
        while copies:
            size = min(copies, rng.randint(1, 4))
            clusters.append(Cluster(invoice, size))
            copies -= size
    rng.shuffle(clusters)
    return [Cluster(c.invoice, c.copies, BY_NAME if rng.random() < by_name else APP) for c in clusters]


def burst(tasks: int, invoices: int, rng: random.Random) -> list[int]:
    """The invoice ids of :func:`plan`'s calls, in the order they are sent."""
    return [c.invoice for c in plan(tasks, invoices, rng) for _ in range(c.copies)]


def summary_table(
    summary: Summary, *, wall: float, total: float, killed: str, contended: str = "skip"
) -> Table:
    table = Table(title="celery-redlock demo", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    overlaps = len(summary.overlaps)
    once, invoices = summary.charged_once, len(summary.charges)
    rows = [
        ("charge calls submitted", str(summary.submitted)),
        ("· charged the invoice", str(summary.count(CHARGED))),
        ("· deduplicated at enqueue", str(summary.count(DEDUPLICATED))),
        ("· skipped: invoice locked", str(summary.count(SKIPPED))),
        ("· found it already charged", str(summary.count(ALREADY))),
        ("· lost", _verdict(summary.lost, summary.lost == 0)),
        ("invoices charged exactly once", _verdict(f"{once} of {invoices}", once == invoices)),
        ("overlaps found by the checker", _verdict(overlaps, not overlaps)),
        ("bodies run under the lock", str(summary.ran)),
        # Under "skip" a refused run is retried, not skipped, when the holder let go before it
        # could be named: there was no one to skip for, and the invoice may still need its charge.
        (
            "runs retried: invoice locked"
            if contended == "retry"
            else "runs retried: lock freed before they could skip",
            str(summary.waited),
        ),
        ("runs retried: masters did not answer", str(summary.unavailable)),
        ("lock acquire latency p50", f"{summary.acquire_p50 * 1000:.1f} ms"),
        ("lock acquire latency p99", f"{summary.acquire_p99 * 1000:.1f} ms"),
        ("master killed mid-burst", killed),
        ("burst wall time", f"{wall:.2f} s"),
        ("demo wall time (with start-up)", f"{total:.2f} s"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _verdict(value: object, good: bool) -> str:
    return f"[{'green' if good else 'bold red'}]{value}[/]"


def headline(summary: Summary) -> str:
    """The verdict in one line: ``300 charge calls, 30 of 30 invoices charged exactly once, ...``."""
    return (
        f"{summary.submitted} charge calls, {summary.charged_once} of {len(summary.charges)} invoices "
        f"charged exactly once, {summary.lost} calls lost, {len(summary.overlaps)} overlaps"
    )


def story(summary: Summary, reader: LedgerReader) -> list[str]:
    """What the calls of one invoice saw, grouped: the invoice whose calls ended the most ways."""
    by_invoice = sorted(reader.calls.values(), key=lambda call: call.invoice)
    if not by_invoice:
        return []
    calls = max(
        (list(group) for _, group in groupby(by_invoice, key=lambda call: call.invoice)),
        key=lambda group: len({summary.ended.get(call.task_id) for call in group}),
    )
    runs = {run.task_id: run for run in reader.runs}
    order = (CHARGED, DEDUPLICATED, SKIPPED, ALREADY)
    ways = sorted(
        ((summary.ended.get(call.task_id, ""), call) for call in calls),
        key=lambda pair: order.index(pair[0]) if pair[0] in order else len(order),
    )
    lines: dict[str, int] = {}
    for way, call in ways:
        line = _saw(way, call.task_id, call.existing, reader, runs)
        lines[line] = lines.get(line, 0) + 1
    head = f"what the {len(calls)} calls of invoice {calls[0].invoice} saw:"
    return [head, *(f"  {n} {'call' if n == 1 else 'calls'} {line}" for line, n in lines.items())]


def _saw(way: str, task_id: str, existing: str | None, reader: LedgerReader, runs: dict[str, Any]) -> str:
    if way == CHARGED:
        return f"charged it (task {task_id[:8]})"
    if way == DEDUPLICATED:
        return f"deduplicated at enqueue: handed task {str(existing)[:8]}, queued or running"
    if way == SKIPPED:
        return f"skipped: task {str(reader.skips[task_id].holder)[:8]} held the invoice's lock"
    if way == ALREADY:
        return f"found it already charged by task {runs[task_id].charged_by[:8]}"
    return f"[red]{way or 'lost'}[/]"


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

        calls = plan(options.tasks, options.invoices, rng, options.by_name)
        reader = LedgerReader(ledger_dir)
        started = time.monotonic()
        killed = _Burst(calls, options, reader, LedgerWriter(ledger_dir), console).run(masters, rng)
        wall = time.monotonic() - started

        for worker in workers:
            worker.stop()
        reader.poll()
        summary = summarize(reader, options.tasks)
        total = time.monotonic() - began
        console.print(
            summary_table(summary, wall=wall, total=total, killed=killed, contended=options.contended)
        )
        for line in story(summary, reader):
            console.print(line)
        _report_failures(summary, options, workers, ledger_dir, console)
        console.print(_verdict(headline(summary), summary.ok))
        return 0 if summary.ok else 1


def _report_failures(
    summary: Summary, options: DemoOptions, workers: list[CeleryWorker], ledger_dir: Path, console: Console
) -> None:
    for first, second in summary.overlaps[:10]:
        console.print(
            f"[red]overlap on {first.resource}: pid {first.pid} held it "
            f"{first.start:.3f}-{first.end:.3f}, pid {second.pid} from {second.start:.3f}"
        )
    for invoice, charges in summary.charges.items():
        if charges != 1:
            console.print(f"[red]invoice {invoice} was charged {charges} times")
    lost = [task_id for task_id, way in summary.ended.items() if way in LOST]
    for task_id in lost[:10]:
        console.print(f"[red]call {task_id} ended no accounted way: {summary.ended[task_id]}")
    if summary.finished < summary.submitted:
        console.print(
            f"[red]{summary.submitted - summary.finished} calls did not finish within "
            f"{options.deadline:.0f} s; worker logs were in {ledger_dir / 'logs'}"
        )
        for worker in workers:
            console.print(worker.log_tail(1500), markup=False)


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


class _Burst:
    """Sends the planned clusters spread over ``options.spread`` seconds, records each call in
    the ledger, and shows the progress until every call ended or the deadline passed, killing a
    master half-way if asked."""

    def __init__(
        self,
        clusters: list[Cluster],
        options: DemoOptions,
        reader: LedgerReader,
        writer: LedgerWriter,
        console: Console,
    ) -> None:
        self.clusters = clusters
        self.total = sum(cluster.copies for cluster in clusters)
        self.options = options
        self.reader = reader
        self.writer = writer
        self.console = console
        self.gap = options.spread / max(1, len(clusters))
        self.next = 0

    def run(self, masters: ServerSet | None, rng: random.Random) -> str:
        """Which master was killed ("no" if none)."""
        from . import tasks as demo_tasks

        started = time.monotonic()
        deadline = started + self.options.deadline
        killed = "no"
        with self._progress() as progress, demo_tasks.app.producer_or_acquire() as producer:
            sent_bar = progress.add_task("calls sent", total=self.total)
            ended_bar = progress.add_task("calls ended", total=self.total)
            while self.reader.finished < self.total and time.monotonic() < deadline:
                sent = self._send_due(started, producer)
                self.reader.poll()
                progress.update(sent_bar, completed=sent)
                progress.update(ended_bar, completed=self.reader.finished)
                if self.options.kill_master and killed == "no" and self.reader.finished >= self.total // 2:
                    killed = _kill_one(masters, rng, self.console)
                time.sleep(POLL if self.next == len(self.clusters) else min(POLL, self.gap))
        return killed

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )

    def _send_due(self, started: float, producer: Any) -> int:
        """Send the clusters due by now (for at most a poll interval, so the progress moves);
        how many calls were sent in all."""
        now = time.monotonic()
        while self.next < len(self.clusters) and started + self.next * self.gap <= now:
            self._send(self.clusters[self.next], producer)
            self.next += 1
            if self.next == len(self.clusters):
                self.console.print(
                    f"submitted {self.total} charge_invoice calls over {self.options.invoices} invoices "
                    f"in {time.monotonic() - started:.1f} s"
                )
            if time.monotonic() - now > POLL:
                break
        return sum(cluster.copies for cluster in self.clusters[: self.next])

    def _send(self, cluster: Cluster, producer: Any) -> None:
        """Each copy of ``cluster``: through the task class (a duplicate is handed the queued
        call's task id, and nothing is published) or by name (always published)."""
        from . import tasks as demo_tasks

        args = (cluster.invoice,)
        for _ in range(cluster.copies):
            task_id = uuid()
            existing = None
            if cluster.via == BY_NAME:
                demo_tasks.app.send_task(demo_tasks.TASK_NAME, args, task_id=task_id, producer=producer)
            else:
                result = demo_tasks.charge_invoice.apply_async(args, task_id=task_id, producer=producer)
                existing = None if result.id == task_id else result.id
            self.writer.write("sent", task_id=task_id, invoice=args[0], via=cluster.via, existing=existing)


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
