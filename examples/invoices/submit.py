"""Send every invoice several times over, as a busy front end would, and show what was charged.

    python submit.py --invoices 20 --copies 5

Exit status 0 iff every invoice was charged exactly once.
"""

from __future__ import annotations

import argparse
import random
import sys

from celery import group
from tasks import charge_invoice, db


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="submit duplicate charge_invoice calls")
    parser.add_argument("--invoices", type=int, default=20)
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    calls = [invoice for invoice in range(1, args.invoices + 1) for _ in range(args.copies)]
    random.shuffle(calls)
    results = group(charge_invoice.s(invoice) for invoice in calls).apply_async()
    outcomes = results.get(timeout=args.timeout)
    with db() as conn:
        charges = dict(
            conn.execute("SELECT invoice_id, count(*) FROM charges GROUP BY invoice_id").fetchall()
        )
    twice = {invoice: n for invoice, n in charges.items() if n != 1}
    print(
        f"{len(calls)} calls: {outcomes.count('charged')} charged, "
        f"{outcomes.count('already paid')} found the invoice already paid; "
        f"{len(charges)} invoices charged, {len(twice)} charged more than once"
    )
    return 0 if len(charges) == args.invoices and not twice else 1


if __name__ == "__main__":
    sys.exit(main())
