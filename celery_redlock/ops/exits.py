"""The exit statuses of the operators' commands, one scheme for every command of both front ends
(``celery redlock ...`` and ``celery-redlock ...``); docs/cli.md lists them per command.

The statuses are chosen so a script can tell "the answer is no" from "no answer": a cron job
that frees stuck locks must not read a fleet it could not reach as a fleet with nothing held.
"""

from __future__ import annotations

OK = 0  # the command did what was asked, and the answer is yes
NO = 1  # a quorum answered, and the answer is no: not held, refused, degraded, incomplete
USAGE = 2  # a bad option or setting (click's own status for usage errors): nothing was asked
UNAVAILABLE = 3  # fewer than a quorum of masters answered (or are sound): no answer to give

# Where the help points: an installed package carries no docs/ folder.
DOCS = "https://celery-redlock.readthedocs.io/en/latest/cli/"

EPILOG = (
    "Exit status: 0 ok; 1 a quorum answered and the answer is no (lock not held, release "
    "refused or declined, fleet degraded, listing incomplete, no leader); 2 usage error (a bad "
    "option, URL or setting); 3 fewer than a quorum of masters answered (for health: are "
    # \b: a paragraph click does not rewrap, so the address is never split at a hyphen.
    f"sound): nothing can be told.\n\n\b\nThe commands, their --json fields and exit statuses:\n{DOCS}"
)
