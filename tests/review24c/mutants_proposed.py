"""Mutants the issue 24 (c) review proposes for :mod:`tests.mutations.mutants` (same shape):
plausible bugs in the "no lost work" fixes that the existing tests let through, each with the
review test that catches it."""

from __future__ import annotations

from tests.mutations.mutants import Edit, Mutant

QUEUED = "celery_redlock/celery/queued.py"
ENQUEUE = "celery_redlock/celery/enqueue.py"
R24_EXPIRES = "tests/review24c/test_review24c_expires.py"
R24_ENDS = "tests/review24c/test_review24c_ends.py"
R24_HEARTBEAT = "tests/review24c/test_review24c_heartbeat.py"

PROPOSED: tuple[Mutant, ...] = (
    Mutant(
        "marker_ttl_expires_from_the_countdown",
        "a numeric expires counted from the countdown: the marker outlives a message that expired",
        (f"{R24_EXPIRES}::test_the_marker_never_outlives_the_calls_expires[number-2.0]",),
        (
            Edit(
                QUEUED,
                "    left = float(expires) if isinstance(expires, int | float) else _seconds_until(expires)",
                "    left = float(expires) + max(0.0, delay or 0.0) if isinstance(expires, int | float) "
                "else _seconds_until(expires)",
            ),
        ),
    ),
    Mutant(
        "marker_ttl_ignores_iso_expires",
        "an ISO-text expires (a retry's) does not cap the marker",
        (f"{R24_EXPIRES}::test_the_marker_never_outlives_the_calls_expires[iso-None]",),
        (
            Edit(
                QUEUED,
                "    if isinstance(when, str):\n        try:\n"
                "            when = dt.datetime.fromisoformat(when)\n"
                "        except ValueError:\n            return None",
                "    if isinstance(when, str):\n        return None",
            ),
        ),
    ),
    Mutant(
        "enqueue_old_markers_taken_as_pending",
        "a marker written without the published flag (an older version's) is waited for as unpublished",
        (f"{R24_EXPIRES}::test_a_marker_written_without_the_published_flag_answers_a_duplicate_at_once",),
        (
            Edit(
                ENQUEUE,
                "    pending = record.queued and record.published is False",
                "    pending = record.queued and record.published is not True",
            ),
        ),
    ),
    Mutant(
        "discarded_marker_beside_the_key_kept",
        "a discarded message's marker waiting beside the key (another holder) is not deleted",
        (
            f"{R24_ENDS}::test_a_discarded_message_whose_marker_waits_beside_the_key_frees_it[unregistered]",
            f"{R24_ENDS}::test_a_discarded_message_whose_marker_waits_beside_the_key_frees_it[rejected]",
        ),
        (
            Edit(
                "celery_redlock/celery/discarded.py",
                '    owner = name or headers.get("task")',
                "    owner = None",
            ),
        ),
    ),
    Mutant(
        "forget_announces_an_owned_lock_lost",
        "forgetting a kept lock that is still owned announces lock_lost",
        (f"{R24_HEARTBEAT}::test_forgetting_a_kept_lock_still_owned_announces_no_loss",),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "        if owed is not None and entry is not None and lock.token == entry.token"
                " and not lock.owned():",
                "        if owed is not None and entry is not None and lock.token == entry.token:",
            ),
        ),
    ),
)
