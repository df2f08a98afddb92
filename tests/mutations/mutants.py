"""The planted bugs :mod:`tests.mutations.run` runs: each is a list of exact text replacements
in the library and the tests that must catch it.

An edit's ``old`` text must occur exactly once in its file, or the mutant is *stale*: the code
moved on, and the mutant must be written again against it. Texts are kept to the few lines that
carry the rule (with just enough context to be unique), so an unrelated edit elsewhere in the
file leaves them valid. ``tests`` are pytest node ids (a file, a function, or one
parametrization such as ``[embedded]``), chosen so each mutant runs in well under a minute.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str  # what the planted bug breaks, in a few words
    tests: tuple[str, ...]
    edits: tuple[Edit, ...]


REDLOCK = "celery_redlock/lock/redlock.py"
RESOURCE = "celery_redlock/lock/resource.py"
SCRIPTS = "celery_redlock/lock/scripts.py"
FENCING = "celery_redlock/lock/fencing.py"
TASK = "celery_redlock/celery/task.py"
TRACER = "celery_redlock/celery/tracer.py"
TALLY = "celery_redlock/lock/tally.py"
SETTINGS = "celery_redlock/lock/settings.py"
ROUNDS = "celery_redlock/lock/rounds.py"
STATE = "celery_redlock/lock/state.py"
ROUND = "celery_redlock/lock/transport/round.py"
REFERENCE = "celery_redlock/lock/transport/reference.py"
MASTER = "celery_redlock/lock/transport/master.py"
NOSCRIPT_TESTS = "tests/core/test_noscript.py::"
RUNSTATE = "celery_redlock/celery/runstate.py"
REVIEW26 = "tests/review26/test_review26_transports.py"
REVIEW26_RUNS = "tests/review26/test_review26_runstate.py"
ENQUEUE = "celery_redlock/celery/enqueue.py"
QUEUED = "celery_redlock/celery/queued.py"
ENQUEUE_LOST = "tests/celery/test_celery_enqueue_lost.py"
HOOKS = "celery_redlock/celery/hooks.py"
MARKER_ENDS = "tests/celery/test_celery_marker_ends.py"
WARNINGS = "tests/celery/test_celery_warnings_name_masters.py"
R24_EXPIRES = "tests/review24c/test_review24c_expires.py"
R24_ENDS = "tests/review24c/test_review24c_ends.py"
R24_HEARTBEAT = "tests/review24c/test_review24c_heartbeat.py"
R24_SLOW = "tests/review24c/test_review24c_slow_masters.py"

# The counter's reading, max(counter, clock in us), taken in a step of its own before the SET:
# what FENCED_ACQUIRE reads, but no longer in the step that sets the key.
_EARLY_READ = (
    "local t = redis.call('TIME') local c = t[1] * 1000000 + t[2] "
    "local s = tonumber(redis.call('GET', KEYS[1]) or '0') if s > c then c = s end return c"
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "quorum_off_by_one",
        "quorum N//2: two disjoint 'majorities' of 4 masters",
        ("tests/core/test_quorum.py::test_acquire_succeeds_iff_a_quorum_is_free[embedded-fast]",),
        (
            Edit(
                SETTINGS,
                "self.quorum = len(self.masters) // 2 + 1",
                "self.quorum = len(self.masters) // 2",
            ),
        ),
    ),
    Mutant(
        "validity_ignores_elapsed",
        "a round slower than the TTL still grants; validity from the reply",
        (
            "tests/core/test_lock_semantics.py::test_acquire_true_while_owned_false_when_connecting_is_slow"
            "[embedded-fast]",
            "tests/core/test_failures.py::test_validity_counts_from_before_the_round_not_from_when_it_is_read"
            "[embedded-fast]",
        ),
        (
            Edit(
                ROUNDS,
                "    validity = ttl - elapsed - redlock.drift(ttl)\n    if expiry is not None:",
                "    validity = ttl - redlock.drift(ttl)\n    if expiry is not None:",
            ),
            Edit(
                STATE,
                "valid_until = started + self.ttl - self.redlock.drift(self.ttl)",
                "valid_until = now() + self.ttl - self.redlock.drift(self.ttl)",
            ),
        ),
    ),
    Mutant(
        "validity_ignores_drift",
        "validity ends when the masters' keys do, not a drift earlier",
        (
            "tests/core/test_validity_drift.py::test_validity_ends_a_drift_before_any_master_lets_the_key_go[embedded]",
        ),
        (Edit(SETTINGS, "return ttl * self.drift_factor + CLOCK_DRIFT_FLOOR", "return 0.0"),),
    ),
    Mutant(
        "failed_acquire_not_retracted",
        "a failed attempt leaves its keys on the masters that granted",
        (
            "tests/core/test_failures.py::test_failed_acquire_with_a_paused_master_leaves_nothing[embedded-fast]",
        ),
        (
            Edit(
                TALLY,
                'return [None if vote.kind == "held" else release for vote in votes]',
                "return [None for vote in votes]",
            ),
        ),
    ),
    Mutant(
        "release_without_compare",
        "release deletes another token's key (DEL without GET == token)",
        ("tests/core/test_quorum.py::test_release_never_deletes_another_tokens_key[embedded-fast]",),
        (
            Edit(
                SCRIPTS,
                '"release",\n    """\nif redis.call(\'GET\', KEYS[1]) == ARGV[1] then',
                '"release",\n    """\nif redis.call(\'EXISTS\', KEYS[1]) == 1 then',
            ),
        ),
    ),
    Mutant(
        "extend_revives_expired",
        "an extension sets a key that had expired (no token check when absent)",
        (
            "tests/core/test_extend_expired.py::"
            "test_the_extend_script_creates_no_key_and_leaves_another_tokens_alone[embedded]",
            "tests/core/test_extend_expired.py::test_a_key_expired_on_a_majority_is_not_revived_by_the_extension",
        ),
        (
            Edit(
                SCRIPTS,
                '"extend",\n    """\nif redis.call(\'GET\', KEYS[1]) == ARGV[1] then',
                '"extend",\n    """\n'
                "if redis.call('SET', KEYS[1], ARGV[1], 'NX') or redis.call('GET', KEYS[1]) == ARGV[1] then",
            ),
        ),
    ),
    Mutant(
        "fence_minority_write_back",
        "a fence recorded by a minority is granted; a later quorum repeats it",
        ("tests/core/test_fence_minority.py",),
        (
            Edit(
                FENCING,
                "if recorded >= redlock.quorum and validity > 0:",
                "if recorded >= 1 and validity > 0:",
            ),
        ),
    ),
    Mutant(
        "fence_read_outside_acquire",
        "the counter read in a step before the SET: a later hold gets a lower fence",
        (
            "tests/core/test_fence_read_order.py::test_a_later_hold_carries_the_larger_fence_when_the_grants_overlap[embedded]",
        ),
        (
            Edit(
                FENCING,
                "    try:\n        first = yield Call(",
                f'    early = yield Call([("EVAL", "{_EARLY_READ}", 1, counter)] * n, '
                "redlock.request_timeout)\n"
                "    try:\n        first = yield Call(",
            ),
            Edit(
                FENCING,
                "    votes, granted, fence = _round_one(redlock, first)\n",
                "    votes, granted, fence = _round_one(redlock, first)\n"
                '    fence = max(o.value for o in early if o.kind == "ok") + 1\n',
            ),
        ),
    ),
    Mutant(
        "release_not_waited",
        "release returns before the masters applied it (rnd.send)",
        (
            "tests/core/test_release_contract.py::"
            "test_an_acquire_started_after_release_returned_is_never_refused[embedded-fast-slow-plain]",
        ),
        (
            Edit(
                ROUNDS,
                "    outcomes = yield Call(\n"
                "        [command] * len(redlock.tally.names), redlock.request_timeout, keep=True, "
                "enough=redlock.quorum\n"
                "    )\n"
                "    if quorum_answered(outcomes, redlock.quorum):",
                "    yield Send([command] * len(redlock.tally.names), redlock.request_timeout)\n    if True:",
            ),
        ),
    ),
    Mutant(
        "task_released_in_after_return",
        "a run's lock outlives its visible completion (released in after_return)",
        (
            "tests/celery/test_celery_core.py::"
            "test_a_finished_run_never_blocks_the_next_run_or_another_client",
            # The next link is published before the result is stored: under a pool that runs it
            # at once, it finds the lock held (the solo test above races the client's read).
            "tests/golden_celery/test_golden_paths.py::"
            "test_outcome_matches_the_golden_file[threads-chain_of_three_on_one_key]",
            "tests/golden_celery/test_golden_paths.py::"
            "test_outcome_matches_the_golden_file[prefork-chain_of_three_on_one_key]",
        ),
        (
            Edit(
                TRACER,
                "    finally:\n        if state != RETRY:\n            task._redlock_finish(state, run)\n",
                "    finally:\n        pass\n",
            ),
        ),
    ),
    Mutant(
        "unavailable_taken_for_contended",
        "masters that did not answer count as a holder: work skipped",
        (
            "tests/celery/test_celery_unavailable.py::"
            "test_contended_and_unavailable_are_told_apart_by_the_votes",
        ),
        (
            Edit(
                "celery_redlock/errors.py",
                '        held = sum(1 for v in self.votes if v.kind == "held")\n'
                "        return held > len(self.votes) - self.quorum",
                "        return self.held_by_other",
            ),
        ),
    ),
    Mutant(
        "heartbeat_interval_loose",
        "an interval with no room for a missed round is accepted",
        (
            "tests/celery/test_celery_limits.py::"
            "test_a_heartbeat_interval_that_cannot_keep_the_lock_is_refused_at_definition",
            "tests/celery/test_celery_limits.py::test_the_margin_is_checked_with_the_apps_request_timeout",
        ),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "    return ttl - drift - 2 * request_timeout",
                "    return ttl - drift",
            ),
        ),
    ),
    Mutant(
        "fair_poll_naps_before_join",
        "poll mode naps between probe and join: later arrivals go first",
        ("tests/core/test_fair.py::test_poll_mode_keeps_arrival_order_too[embedded-fast]",),
        (
            Edit(
                "celery_redlock/lock/fair.py",
                "        return bool(entry.ticket) and not entry.placed",
                "        return False",
            ),
        ),
    ),
    Mutant(
        "fair_release_wakes_the_herd",
        "a fair release wakes every waiter, not only the new head of the queue",
        (
            "tests/core/test_fair.py::test_threads_are_granted_in_arrival_order_one_wake_each[embedded-fast-10]",
        ),
        (
            Edit(
                "celery_redlock/lock/scripts.py",
                "redis.call('PUBLISH', KEYS[1], redis.call('ZRANGE', KEYS[2], 0, 0)[1] or '*')",
                "redis.call('PUBLISH', KEYS[1], '*')",
            ),
        ),
    ),
    Mutant(
        "max_hold_capped_on_every_pool",
        "the task's time_limit caps the heartbeat on pools that enforce none",
        (
            "tests/celery/test_celery_limits.py::"
            "test_a_lock_never_expires_under_a_body_its_limit_does_not_end[threads]",
        ),
        (
            Edit(
                TASK,
                "        if not _in_prefork_child():\n            return None\n",
                "",
            ),
        ),
    ),
    Mutant(
        "max_hold_ignores_the_calls_limit",
        "the task's time_limit caps a call that raised its own limit",
        (
            "tests/celery/test_celery_limits.py::"
            "test_a_lock_never_expires_under_a_body_its_limit_does_not_end[prefork]",
        ),
        (
            Edit(
                HOOKS,
                'return limits[0] or getattr(task, "time_limit", None) or',
                'return getattr(task, "time_limit", None) or limits[0] or',
            ),
        ),
    ),
    Mutant(
        "apps_time_limit_change_unseen",
        "a change of the app's task_time_limit after first use is not read by the next run",
        (
            "tests/celery/test_celery_config.py::"
            "test_the_apps_time_limit_is_read_with_the_settings_and_its_change_seen",
        ),
        (
            Edit(
                "celery_redlock/celery/settings.py",
                "WATCHED_SETTINGS = (*DEFAULTS, *CELERY_SETTINGS_READ)",
                "WATCHED_SETTINGS = (*DEFAULTS,)",
            ),
        ),
    ),
    Mutant(
        "apps_time_limit_watched_by_one_name_only",
        "a change of the time limit under its Django or old-style name after first use is not read",
        (
            "tests/celery/test_celery_config.py::"
            "test_the_apps_time_limit_is_read_as_celery_reads_it_in_every_style",
        ),
        (
            Edit(
                "celery_redlock/celery/settings.py",
                "else (k for name in WATCHED_SETTINGS for k in to_keys(name))",
                "else (*(k for name in DEFAULTS for k in to_keys(name)), *CELERY_SETTINGS_READ)",
            ),
        ),
    ),
    Mutant(
        "release_wait_spins_on_a_closed_link",
        "a release waiting on paused masters spins on an answered link's hang-up until its deadline",
        (
            "tests/core/test_release_wait.py::"
            "test_a_release_waiting_on_paused_masters_does_not_spin_on_a_closed_link[fast]",
        ),
        (
            Edit(
                "celery_redlock/lock/transport/linkset.py",
                "        if ready and ready.isdisjoint(fds):",
                "        if ready and not fds:",
            ),
        ),
    ),
    Mutant(
        "release_wait_ignores_its_own_poll",
        "a release whose round took its links one by one never reads what its poll reported",
        ("tests/core/test_release_wait.py::test_a_release_on_links_taken_one_by_one_returns_at_once",),
        (
            Edit(
                "celery_redlock/lock/transport/linkset.py",
                "    return None, {fd for fd, _ in poller.poll(remaining * 1000)}",
                "    poller.poll(remaining * 1000)\n    return None, set()",
            ),
        ),
    ),
    Mutant(
        "release_timeout_said_to_be_a_quorum",
        "a release no quorum answered calls its silent masters 'not waited for once a quorum had answered'",
        (
            "tests/core/test_release_wait.py::"
            "test_a_release_waiting_on_paused_masters_does_not_spin_on_a_closed_link[fast]",
        ),
        (
            Edit(
                ROUND,
                "unanswered = NOT_AWAITED if ok >= enough else LATE",
                "unanswered = NOT_AWAITED",
            ),
        ),
    ),
    Mutant(
        "reentrant_inner_exit_frees",
        "an inner exit of a reentrant lock frees it for everyone",
        ("tests/core/test_reentrant.py::test_depth_is_mirrored_and_only_the_last_exit_frees[embedded-fast]",),
        (
            Edit(
                "celery_redlock/lock/reentrant.py",
                "            last = found.depth <= 0",
                "            last = True",
            ),
        ),
    ),
    Mutant(
        "handover_retracted_by_release",
        "a takeover no quorum granted deletes its marker: a duplicate publish is accepted",
        (
            "tests/core/test_markers_side.py::test_a_takeover_no_quorum_granted_leaves_its_marker_beside_the_key"
            "[embedded]",
        ),
        (Edit("celery_redlock/lock/markers.py", "undo=self._retraction(token, entry),", "undo=None,"),),
    ),
    Mutant(
        "handover_leaves_its_marker_beside_held_keys",
        "a run's marker stays beside the key where it was held: its task's publishes are refused",
        (
            "tests/core/test_markers_side.py::"
            "test_a_takeover_granted_by_a_quorum_deletes_its_marker_where_the_key_was_held[embedded]",
        ),
        (Edit("celery_redlock/lock/markers.py", "tidy=self._tidy(token),", "tidy=None,"),),
    ),
    Mutant(
        "tidy_leaves_the_marker_on_the_lock_key",
        "a marker on the lock key of a master down at the takeover outlives the run there",
        (
            "tests/review31/test_review31_tidy.py::test_a_takeover_with_a_master_unreachable_leaves_no_marker_on_its_lock_key",
        ),
        (
            Edit(
                SCRIPTS,
                "if held == ARGV[1] or held == ARGV[2] or held == ARGV[3] then",
                "if held == ARGV[1] then",
            ),
        ),
    ),
    Mutant(
        "tidy_deletes_any_marker_beside_the_key",
        "a late tidy deletes a later message's marker: a duplicate publish is accepted",
        (
            "tests/review31/test_review31_tidy.py::test_a_tidy_written_late_leaves_a_later_messages_marker_beside_the_key",
        ),
        (
            Edit(
                SCRIPTS,
                "if beside == ARGV[2] or beside == ARGV[3] then",
                "if beside then",
            ),
        ),
    ),
    Mutant(
        "tidy_only_for_masters_that_refused",
        "a master down at the takeover keeps the run's marker beside the key",
        (
            "tests/review31/test_review31_tidy.py::test_a_tidy_kept_for_a_master_that_was_down_deletes_the_marker_beside_the_key_there",
        ),
        (
            Edit(
                TALLY,
                'return [None if vote.kind == "yes" else command for vote in votes]',
                'return [command if vote.kind == "held" else None for vote in votes]',
            ),
        ),
    ),
    Mutant(
        "release_publishes_nothing",
        "waiters are not woken by a release, only by their fallback poll",
        ("tests/core/test_waiting.py::test_woken_by_release_not_by_polling[embedded]",),
        (
            Edit(
                SCRIPTS,
                "    redis.call('DEL', KEYS[1])\n"
                "    redis.call('PUBLISH', KEYS[1], '*')\n"
                "    return 1\n"
                "end\n"
                "return 0\n"
                '""",\n'
                ")\n"
                "\n"
                "# EXTEND",
                '    redis.call(\'DEL\', KEYS[1])\n    return 1\nend\nreturn 0\n""",\n)\n\n# EXTEND',
            ),
        ),
    ),
    Mutant(
        "noscript_not_resent",
        "the fast transport hands a master's NOSCRIPT to the caller: the script never runs there",
        (
            NOSCRIPT_TESTS + "test_the_caller_sees_the_scripts_replies_never_noscript[embedded-fast]",
            NOSCRIPT_TESTS
            + "test_every_kind_acquires_extends_and_releases_while_the_masters_lose_their_scripts"
            "[embedded-fast-fenced]",
        ),
        (Edit(ROUND, "        resent = eval_form(command)\n", "        resent = None\n"),),
    ),
    Mutant(
        "noscript_not_resent_reference",
        "the reference transport hands a master's NOSCRIPT to the caller",
        (NOSCRIPT_TESTS + "test_the_caller_sees_the_scripts_replies_never_noscript[embedded-redis-py]",),
        (
            Edit(
                REFERENCE,
                "and is_noscript(outcome) and eval_form(command) is not None:",
                "and is_noscript(outcome) and eval_form(command) is None:",
            ),
        ),
    ),
    Mutant(
        "scripts_not_loaded_on_connect",
        "a new link does not load the scripts: a restarted master answers NOSCRIPT to what nobody waits for",
        (NOSCRIPT_TESTS + "test_a_new_connection_loads_every_script[embedded-fast]",),
        (Edit(MASTER, "loads = script_loads() if load_scripts else []", "loads = []"),),
    ),
    # -- issue 26: the vote tally, the reference transport, one RunState per run ------------------
    Mutant(
        "tally_late_vote_as_refusal",
        "a late master votes 'held': its write is never retracted",
        (
            "tests/core/test_failures.py::test_failed_acquire_with_a_paused_master_leaves_nothing[embedded-fast]",
            "tests/core/test_failures.py::test_late_write_from_a_paused_master_is_retracted[embedded-fast]",
        ),
        (Edit(TALLY, '        if outcome.kind == "ok":\n', '        if outcome.kind != "error":\n'),),
    ),
    Mutant(
        "tally_late_vote_counted",
        "masters that did not answer count toward the quorum",
        (
            "tests/core/test_quorum.py::test_acquire_succeeds_iff_a_quorum_is_free[embedded-fast]",
            "tests/core/test_failures.py::test_majority_killed_fails_fast_naming_the_dead[embedded-fast]",
        ),
        (
            Edit(
                TALLY,
                'return votes, sum(1 for vote in votes if vote.kind == "yes")',
                'return votes, sum(1 for vote in votes if vote.kind != "held")',
            ),
        ),
    ),
    Mutant(
        "tally_zero_counts_as_grant",
        "a re-entry answered 0 (the token gone) counts as yes",
        (
            "tests/review26/test_review26_tally.py::test_a_reentry_where_a_quorum_lost_the_key_is_lost_not_granted",
        ),
        (Edit(TALLY, "return type(value) is int and value > 0", "return type(value) is int and value >= 0"),),
    ),
    Mutant(
        "reference_late_reported_ok",
        "the reference transport reports a late reply as b'OK'",
        (
            "tests/core/test_failures.py::"
            "test_failed_acquire_with_a_paused_master_leaves_nothing[embedded-redis-py]",
            "tests/core/test_quorum.py::test_acquire_succeeds_iff_a_quorum_is_free[embedded-redis-py]",
        ),
        (
            Edit(
                REFERENCE,
                "results[i] = got + [LATE] * (count - len(got))",
                'results[i] = got + [COMMON_OK[b"OK"]] * (count - len(got))',
            ),
        ),
    ),
    Mutant(
        "reference_kept_dropped",
        "a release the reference transport could not write for a while is dropped",
        (
            f"{REVIEW26}::test_a_release_reaches_a_master_that_restarts_with_its_keys[redis-py]",
            f"{REVIEW26}::test_a_retraction_behind_a_very_late_reply_is_not_lost[redis-py]",
        ),
        (
            Edit(
                REFERENCE,
                "                    self.site.keep(job)\n                    return False\n",
                "                    return False\n",
            ),
        ),
    ),
    Mutant(
        "reference_fork_shares_lanes",
        "a forked child uses the parent's lanes (threads it does not have, the parent's sockets)",
        (
            f"{REVIEW26}::test_a_forked_child_locks_on_connections_of_its_own[redis-py]",
            "tests/core/test_reentrant.py::test_a_forked_child_is_another_owner[embedded-redis-py]",
        ),
        (
            Edit(
                REFERENCE,
                "        old, self._sites = self._sites, [_Site(master) for master in self.masters]\n",
                "        old: list[_Site] = []\n",
            ),
        ),
    ),
    Mutant(
        "reference_idle_check_skipped",
        "a release is written to a connection the master closed while it was idle, and lost",
        (
            f"{REVIEW26}::"
            "test_a_release_on_connections_the_masters_closed_while_idle_deletes_the_keys[release-redis-py]",
        ),
        (
            Edit(
                REFERENCE,
                "if self.conn is not None and self.conn.can_read(timeout=0):",
                "if False:",
            ),
        ),
    ),
    Mutant(
        "runstate_enter_not_recorded",
        "a direct call from the body is taken for the run's call and releases its lock",
        (
            "tests/celery/test_celery_runstate.py::"
            "test_each_run_has_a_state_of_its_own_and_a_direct_call_inside_is_no_run",
        ),
        (Edit(RUNSTATE, "        self.entered = True\n", ""),),
    ),
    Mutant(
        "runstate_begin_keeps_old_state",
        "a run finds an earlier run's state on a reused request",
        (
            "tests/celery/test_celery_runstate.py::"
            "test_a_request_reused_for_a_later_run_starts_from_a_fresh_state",
        ),
        (
            Edit(
                RUNSTATE,
                "    run = RunState(settings=settings)\n    setattr(request, RUN_ATTR, run)\n",
                "    run = getattr(request, RUN_ATTR, None) or RunState(settings=settings)\n"
                "    setattr(request, RUN_ATTR, run)\n",
            ),
        ),
    ),
    Mutant(
        "runstate_finish_twice",
        "a run's end is done twice (the body's end and the backstop): two releases reported",
        (f"{REVIEW26_RUNS}::test_each_run_ends_once_whatever_the_backstops",),
        (
            Edit(
                RUNSTATE,
                "        if held is None or held.finished:\n            return None\n"
                "        held.finished = True\n",
                "        if held is None:\n            return None\n",
            ),
        ),
    ),
    Mutant(
        "runstate_scope_left_open",
        "a reentrant run's owner scope outlives it: the next run in the thread is the same owner",
        (f"{REVIEW26_RUNS}::test_a_reentrant_run_leaves_no_owner_scope_behind",),
        (Edit(RUNSTATE, "            close_scope(scope)\n", "            pass\n"),),
    ),
    Mutant(
        "fence_round_one_takes_the_whole_deadline",
        "a paused minority master leaves a fenced attempt no time for round 2: never granted",
        ("tests/review26/test_review26_fenced.py::test_a_fenced_acquire_is_granted_with_a_paused_minority",),
        (
            Edit(
                FENCING,
                "    halfway = deadline - redlock.request_timeout / 2\n",
                "    halfway = deadline\n",
            ),
        ),
    ),
    Mutant(
        "fast_close_strands_kept_releases",
        "after Redlock.close(), a release kept for a paused master is never delivered",
        (f"{REVIEW26}::test_a_release_made_after_close_reaches_a_paused_master_once_it_resumes[fast]",),
        (
            Edit(
                "celery_redlock/lock/transport/master.py",
                "            self._closed = False\n            if self._delivering:\n",
                "            if self._delivering or self._closed:\n",
            ),
        ),
    ),
    Mutant(
        "enqueue_marker_outlives_expires",
        "a marker outlives its message's expires: later calls are handed a discarded message's id",
        (f"{ENQUEUE_LOST}::test_a_publish_after_the_queued_message_expired_is_not_deduplicated_against_it",),
        (Edit(QUEUED, "    return ttl if left is None else min(ttl, left)", "    return ttl"),),
    ),
    Mutant(
        "enqueue_deduplicates_against_unpublished",
        "a call is handed the id of a publish that never returned: its work never runs",
        (
            f"{ENQUEUE_LOST}::test_a_call_deduplicated_against_a_publisher_that_died_before_its_publish_"
            "still_runs",
        ),
        (
            Edit(
                QUEUED,
                "    pending = record.queued and record.published is False",
                "    pending = False",
            ),
        ),
    ),
    Mutant(
        "queued_reports_unpublished",
        "queued_task_id hands out the id of a publish that has not returned (no message may carry it)",
        (
            f"{ENQUEUE_LOST}::test_a_call_deduplicated_against_a_publisher_that_died_before_its_publish_"
            "still_runs",
        ),
        (Edit(QUEUED, "counted = pending or not holder.pending", "counted = True"),),
    ),
    Mutant(
        "queued_forms_counted_apart",
        "a marker kept on only some masters is counted as two values, neither a quorum: not queued",
        (f"{ENQUEUE_LOST}::test_a_marker_kept_on_only_some_masters_is_still_one_queued_message",),
        (Edit(QUEUED, "            form = markers.published(text)\n", "            form = text\n"),),
    ),
    Mutant(
        "enqueue_plain_lock_on_other_master_names",
        "a run whose message was marked under other names for its masters is refused by its marker",
        (f"{ENQUEUE_LOST}::test_a_message_marked_under_other_names_for_the_same_masters_runs",),
        (
            Edit(
                QUEUED,
                "            masters_fingerprint(redlock),\n        )\n    owner = ",
                "            masters_fingerprint(redlock),\n        )\n"
                "        return redlock.lock(name, ttl, holder=holder)\n    owner = ",
            ),
        ),
    ),
    Mutant(
        "enqueue_stale_result_waits",
        "a duplicate of a running reused task id waits out FINISHING_WAIT for an earlier run's result",
        (f"{ENQUEUE_LOST}::test_a_duplicate_of_a_running_reused_task_id_is_answered_without_waiting",),
        (Edit(ENQUEUE, "        return done.timestamp() >= started - 0.001", "        return True"),),
    ),
    Mutant(
        "beat_dip_refuses",
        "a healthy beat leader in its validity dip writes a run and never sends it",
        ("tests/beat/test_django_races.py::test_a_run_written_in_the_validity_dip_is_sent",),
        (
            Edit(
                "celery_redlock/celery/leader.py",
                "        return lock.extend() and self._leading and lock.validity >= "
                "self._settings.min_validity",
                "        return False",
            ),
        ),
    ),
    Mutant(
        "beat_setup_misses_admin_commit",
        "an entry an admin commits while a django beat leader sets up waits for the 5-minute re-read",
        ("tests/beat/test_django_races.py::test_an_entry_committed_while_a_leader_sets_up_is_run",),
        (
            Edit(
                "celery_redlock/celery/kinds.py",
                "    scheduler._last_timestamp = _earliest_change()",
                "    pass",
            ),
        ),
    ),
    Mutant(
        "marker_kept_by_a_discarded_message",
        "a marked message the consumer discards as an unregistered task keeps its marker",
        (f"{MARKER_ENDS}::test_a_marked_message_a_worker_discards_as_unregistered_frees_its_key",),
        (Edit(HOOKS, "    (celery_signals.task_unknown, discarded.drop_discarded_marker),\n", ""),),
    ),
    Mutant(
        "marker_kept_by_a_rejected_message",
        "a marked message the consumer rejects (a content type it does not accept) keeps its marker",
        (f"{MARKER_ENDS}::test_a_marked_message_a_worker_rejects_for_its_content_type_frees_its_key",),
        (Edit(HOOKS, "    (celery_signals.task_rejected, discarded.drop_discarded_marker),\n", ""),),
    ),
    Mutant(
        "marker_kept_by_a_revoked_wait",
        "a marked run revoked while it waits for the lock keeps its marker",
        (f"{MARKER_ENDS}::test_a_marked_message_revoked_while_it_waits_for_the_lock_frees_its_key",),
        (
            Edit(
                "celery_redlock/celery/contend.py",
                '        enqueue.drop_abandoned_marker(sender=task, key=lock.name, policy="revoked")\n',
                "",
            ),
        ),
    ),
    Mutant(
        "marker_kept_by_a_killed_child",
        "a marked run whose pool child is killed while it waits keeps its marker",
        (
            f"{MARKER_ENDS}::test_a_marked_run_whose_pool_child_is_killed_while_it_waits_frees_its_key",
            f"{MARKER_ENDS}::test_the_hard_time_limits_failure_sent_without_the_request_deletes_the_marker",
        ),
        (
            Edit(
                "celery_redlock/celery/discarded.py",
                "    for carried in found:\n        if carried is not None:\n",
                "    for carried in found:\n        if carried is None:\n",
            ),
        ),
    ),
    Mutant(
        "marker_of_a_hard_limit_failure_not_found",
        "the hard time limit's failure, sent without the run's request, finds no marker to delete",
        (f"{MARKER_ENDS}::test_the_hard_time_limits_failure_sent_without_the_request_deletes_the_marker",),
        (
            Edit(
                "celery_redlock/celery/discarded.py",
                "        _marked[(task_id, carried[1])] = request\n",
                "        pass\n",
            ),
        ),
    ),
    Mutant(
        "wait_outlasts_the_hard_time_limit",
        "a marked run waiting for the lock is killed by its hard time limit: the work is lost",
        (f"{MARKER_ENDS}::test_a_marked_run_with_a_hard_time_limit_is_not_killed_while_it_waits",),
        (
            Edit(
                "celery_redlock/celery/contend.py",
                "(hard, HARD_LIMIT_MARGIN + 2 * request_timeout), (soft, request_timeout)",
                "(soft, request_timeout),",
            ),
        ),
    ),
    Mutant(
        "release_warning_names_no_master",
        "the warning of an unconfirmed release does not say which masters did not answer",
        (f"{WARNINGS}::test_the_warning_of_an_unconfirmed_release_names_the_masters",),
        (
            Edit(
                TASK,
                "join(name_masters(held.lock.release_votes))",
                "join([])",
            ),
        ),
    ),
    Mutant(
        "extension_warning_names_no_master",
        "the warning of a failed heartbeat extension does not say which masters did not extend it",
        (f"{WARNINGS}::test_the_warning_of_a_failed_heartbeat_extension_names_the_masters",),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                '                "; ".join(name_masters(lock.last_votes)) or "the round raised",\n',
                '                "",\n',
            ),
        ),
    ),
    Mutant(
        "keep_refusal_always_warns",
        "every refused keep round warns of a slow publish, a fast worker's takeover included",
        (
            "tests/celery/test_celery_enqueue_progress.py::"
            "test_a_run_that_takes_its_marker_over_before_the_publish_returns_is_no_warning",
        ),
        (Edit(ENQUEUE, "    if age < window - redlock.drift(window) and", "    if False and"),),
    ),
    Mutant(
        "keep_unanswered_taken_for_takeover",
        "a keep round that masters did not answer is taken for a takeover and not warned of",
        (
            "tests/celery/test_celery_enqueue_progress.py::"
            "test_a_marker_dropped_before_the_publish_returns_is_no_warning_but_one_lost_to_dead_masters_is",
        ),
        (Edit(ENQUEUE, " and len(votes) - len(unanswered) >= redlock.quorum:", ":"),),
    ),
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
                QUEUED,
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
    Mutant(
        "wait_cap_ignores_the_workers_time_limit",
        "a wait ignores the worker's --time-limit: the pool kills the waiting run, its work is lost",
        (f"{R24_ENDS}::test_a_marked_run_waiting_under_the_workers_time_limit_option_is_not_killed",),
        (
            Edit(
                HOOKS,
                'or getattr(_worker, "time_limit", None) or app_limit',
                "or app_limit",
            ),
        ),
    ),
    Mutant(
        "wait_cap_ignores_slow_rounds",
        "a wait leaves a fixed margin before the hard limit, not the rounds around it: slow "
        "masters let the limit kill it",
        (f"{R24_SLOW}::test_a_marked_run_waiting_on_slow_masters_is_not_killed_by_its_hard_limit",),
        (
            Edit(
                "celery_redlock/celery/contend.py",
                "(hard, HARD_LIMIT_MARGIN + 2 * request_timeout)",
                "(hard, HARD_LIMIT_MARGIN)",
            ),
            Edit("celery_redlock/celery/contend.py", "cap - (time.monotonic() - started)", "cap"),
        ),
    ),
    Mutant(
        "marker_ttl_not_recounted_after_waiting",
        "a publish that waited out another's marker keeps its own past the message's expires",
        (
            f"{R24_EXPIRES}::test_a_publish_that_waited_for_an_unpublished_marker_still_caps_its_marker_at_expires",
        ),
        (Edit(ENQUEUE, "    ttl = max(marker_ttl(task, settings, options), redlock.min_ttl)\n", ""),),
    ),
    Mutant(
        "marker_ttl_ignores_the_tasks_expires",
        "the task's own expires does not cap its marker: later calls get a message that expired unrun",
        (f"{R24_EXPIRES}::test_the_tasks_own_expires_caps_its_marker",),
        (
            Edit(
                QUEUED,
                'options["expires"] if "expires" in options else getattr(task, "expires", None)',
                'options.get("expires")',
            ),
        ),
    ),
    Mutant(
        "pending_wait_one_window",
        "a call that outwaits one unpublished marker is handed the next one's id, which may "
        "never be published",
        (f"{R24_EXPIRES}::test_a_call_that_outwaits_its_window_is_not_handed_an_unpublished_marker",),
        (
            Edit(ENQUEUE, "    for _ in range(PENDING_WINDOWS):\n", "    for _ in range(1):\n"),
            Edit(
                ENQUEUE,
                "    if isinstance(placed, Existing) and placed.pending:\n        # INVARIANT",
                "    if False:\n        # INVARIANT",
            ),
        ),
    ),
    Mutant(
        "lock_retry_published_before_its_retry_state",
        "a lock retry is published before its run's RETRY state is stored: a copy that ends first "
        "has its FAILURE overwritten by that RETRY for ever",
        ("tests/celery/test_celery_retry_store.py",),
        (
            Edit(
                "celery_redlock/celery/contend.py",
                "    run.retry_later(sig)\n",
                "    sig.apply_async()\n",
            ),
        ),
    ),
    Mutant(
        "lock_retry_lost_when_its_retry_store_raises",
        "a lock retry whose RETRY store (or the task's on_retry) raises is never published: the "
        "task is gone without a trace",
        (
            "tests/celery/test_celery_retry_review.py::test_a_lock_retry_is_published_although_its_retry_signal_is_never_sent[backend-down]",
        ),
        (
            Edit(
                "celery_redlock/celery/hooks.py",
                "    if state != SUCCESS:  # a run that succeeded",
                "    if False:  # a run that succeeded",
            ),
        ),
    ),
    Mutant(
        "own_retry_released_before_its_retry_state",
        "a run that retries itself releases its lock as its body ends: the copy Celery published "
        "takes it at once, finishes first, and has its SUCCESS overwritten by that RETRY for ever",
        (
            "tests/celery/test_celery_retry_store.py::test_a_bodys_own_retry_is_not_overwritten_by_its_late_retry_state",
        ),
        (Edit("celery_redlock/celery/tracer.py", "        if state != RETRY:\n", "        if True:\n"),),
    ),
    Mutant(
        "forget_swallows_the_owed_announcement",
        "forget() takes the callback of a lock lost while kept and never calls it: a loss the "
        "heartbeat had not reached yet is announced by nobody",
        (
            "tests/core/test_heartbeat.py::"
            "test_a_lock_lost_while_the_heartbeat_is_held_up_elsewhere_is_announced_by_forget",
        ),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "                owed(lock, reason)\n",
                "                pass\n",
            ),
        ),
    ),
    Mutant(
        "late_connect_kept_after_close",
        "a link whose connect ends after close() is kept: the closed Redlock's socket stays open",
        (
            "tests/core/test_lock_semantics.py::test_a_link_whose_connect_ends_after_close_is_closed[embedded-fast]",
        ),
        (Edit(MASTER, "            if not (self._closed or self.refusal):\n", "            if True:\n"),),
    ),
    Mutant(
        "dropped_link_parked_again",
        "a round that drops a link parks the set it took, dead link included: the next socket "
        "takes its descriptor, and that master's vote is lost",
        ("tests/core/test_link_sets.py::test_a_link_dropped_mid_round_is_never_used_again[embedded]",),
        (Edit(ROUND, "        self._linkset = None  # see __init__\n", ""),),
    ),
    Mutant(
        "round_closed_twice_parks_again",
        "a round closed twice parks its link set twice: two rounds then share its sockets",
        ("tests/core/test_link_sets.py::test_a_round_closed_twice_parks_its_links_once[embedded-clean]",),
        (
            Edit(
                ROUND,
                "        linkset, self._linkset = self._linkset, None\n",
                "        linkset = self._linkset\n",
            ),
        ),
    ),
    Mutant(
        "inherited_links_left_open",
        "a forked child keeps open the links another thread of its parent held at the fork: "
        "their connections outlive the parent",
        (
            "tests/core/test_link_sets.py::test_a_forked_child_does_not_keep_its_parents_connections_open"
            "[embedded-held-by-a-thread]",
        ),
        (Edit("celery_redlock/lock/transport/link.py", "on_fork_in_child(_close_inherited)\n", ""),),
    ),
    Mutant(
        "reference_lanes_left_open_in_a_child",
        "a forked child keeps the redis-py reference transport's lane connections: their lanes "
        "are held by threads that did not survive the fork, and the connections outlive the parent",
        (
            "tests/core/test_link_sets.py::test_a_forked_child_does_not_keep_its_parents_connections_open"
            "[embedded-reference-transport-lanes]",
        ),
        (
            Edit(
                "celery_redlock/lock/transport/reference.py",
                "                lane.close_inherited()\n",
                "                pass\n",
            ),
        ),
    ),
    Mutant(
        "async_links_kept_in_a_child",
        "a forked child keeps its copies of an AsyncRedlock's connections: they outlive the parent",
        (
            "tests/core/test_link_sets.py::test_a_forked_child_does_not_keep_its_parents_connections_open"
            "[embedded-asyncio]",
        ),
        (Edit("celery_redlock/lock/aio/link.py", "on_fork_in_child(_let_go_inherited)\n", ""),),
    ),
    Mutant(
        "async_listening_links_kept_in_a_child",
        "a forked child keeps its copies of an AsyncRedlock's listening connections (their link "
        "is dropped once its transport speaks to the subscriber): they outlive the parent",
        (
            "tests/core/test_link_sets.py::test_a_forked_child_does_not_keep_its_parents_connections_open"
            "[embedded-asyncio]",
        ),
        (Edit("celery_redlock/lock/aio/subscriber.py", "        let_go_in_a_child(ear)", "        pass"),),
    ),
    Mutant(
        "reentrant_holder_unread",
        "who holds a reentrant lock is not read (its key is a hash): a lock_reentrant task's "
        "duplicate is retried and runs instead of being skipped or failed",
        ("tests/core/test_holder.py::test_a_reentrant_locks_holder_is_read_as_a_plain_locks",),
        (Edit("celery_redlock/lock/holder.py", '{b"string": 4, b"hash": 5}', '{b"string": 4}'),),
    ),
    Mutant(
        "round_cut_short_parks_its_links",
        "a round an exception left mid-wait parks its links: the next round on them reads an old "
        "+OK behind an owed reply as its own grant",
        ("tests/core/test_link_sets.py::test_a_round_left_by_an_exception_never_counts_its_stale_replies",),
        (Edit("celery_redlock/lock/transport/round.py", "        if self._busy:\n", "        if False:\n"),),
    ),
    Mutant(
        "async_connect_under_way_kept_in_a_child",
        "a socket whose connect is under way at a fork is not let go of in the child: the "
        "parent's connection stays open on the master after the parent is gone",
        (
            "tests/asyncio/test_async_fork.py::test_a_connect_under_way_at_the_fork_does_not_outlive_the_parent",
        ),
        (Edit("celery_redlock/lock/aio/handshake.py", "        let_go_in_a_child(sock)\n", ""),),
    ),
    Mutant(
        "async_child_not_told_of_the_fork",
        "a forked child calling its parent's AsyncRedlock is told only of another event loop",
        ("tests/asyncio/test_async_fork.py",),
        (
            Edit(
                "celery_redlock/lock/aio/exchange.py",
                "        if self.pid != pid():\n",
                "        if False:\n",
            ),
        ),
    ),
    Mutant(
        "connects_share_a_small_pool",
        "connects run on a shared pool of four threads: a connect queued behind hung ones starts "
        "a whole timeout late, and a healthy Redlock waits for another's unreachable master",
        (
            "tests/core/test_slow_connect.py::"
            "test_connects_that_cost_their_whole_timeout_hold_up_no_other_redlock",
        ),
        (
            Edit(
                "celery_redlock/lock/transport/threads.py",
                "    future: Future[Any] = Future()\n",
                "    from concurrent.futures import ThreadPoolExecutor\n\n"
                "    global _POOL\n"
                "    _POOL = globals().get('_POOL') or ThreadPoolExecutor(4)\n"
                "    return _POOL.submit(function, *args)\n"
                "    future: Future[Any] = Future()\n",
            ),
        ),
    ),
    Mutant(
        "queued_guesses_when_silent",
        "is_queued / queued_task_id read 'not queued' when too few masters answered to tell",
        ("tests/celery/test_celery_queued_unanswered.py",),
        (
            Edit(
                QUEUED,
                "    if undecided or len(silent) >= redlock.quorum:\n",
                "    if False:\n",
            ),
        ),
    ),
    Mutant(
        "queued_raises_when_decided",
        "is_queued raises for any silent master, though the answering ones decide it",
        ("tests/celery/test_celery_queued_unanswered.py",),
        (
            Edit(
                QUEUED,
                "    if undecided or len(silent) >= redlock.quorum:\n",
                "    if silent:\n",
            ),
        ),
    ),
    Mutant(
        "drop_keeps_quiet",
        "a marker the masters did not confirm deleted is left behind without a word",
        ("tests/core/test_marker_drop.py",),
        (
            Edit(
                "celery_redlock/lock/markers.py",
                "    if names:\n        logger.warning(",
                "    if False:\n        logger.warning(",
            ),
        ),
    ),
    Mutant(
        "drop_reaches_a_quorum_only",
        "the marker is deleted on a quorum of masters and left on the others",
        ("tests/core/test_marker_drop.py",),
        (
            Edit(
                "celery_redlock/lock/markers.py",
                "        replies = rnd.call_many([batch] * len(redlock.masters), redlock.request_timeout)\n",
                "        replies = rnd.call_many([batch] * redlock.quorum"
                " + [[]] * (len(redlock.masters) - redlock.quorum), redlock.request_timeout)\n",
            ),
        ),
    ),
    Mutant(
        "queued_placed_form_passed_over_when_silent",
        "a marker seen only as placed is passed over though a silent master may hold it published: "
        "queued_task_id reads 'not queued'",
        ("tests/review24d/test_review24d_unsettled.py",),
        (Edit(QUEUED, "and (counted or silent):", "and counted:"),),
    ),
    Mutant(
        "deaf_waiter_sleeps_its_whole_poll",
        "a waiter too few of whose refusers can wake it (a join a minority acknowledged) sleeps its "
        "whole wait_poll",
        (
            "tests/core/test_fair.py::test_a_waiter_whose_join_a_majority_answered_late_takes_the_lock_soon_after_its_release",
        ),
        (
            Edit(
                "celery_redlock/lock/rooms.py",
                "    deaf_until = t + random.uniform(0, settings.retry_delay)\n",
                "    deaf_until = until\n",
            ),
        ),
    ),
    Mutant(
        "split_vote_refused_after_a_few_tries",
        "a vote split between publishers is refused after PLACE_ATTEMPTS tries like an unanswered "
        "round: a burst's publish raises LockNotAcquired though nobody holds the key",
        (
            "tests/celery/test_celery_enqueue_place.py::test_a_vote_split_by_two_dead_publishers_is_waited_out_not_refused",
        ),
        (
            Edit(
                "celery_redlock/celery/enqueue.py",
                "    return not name_masters(placed.votes, UNANSWERED) and time.monotonic() < deadline\n",
                "    return False\n",
            ),
        ),
    ),
    Mutant(
        "split_vote_tried_for_ever",
        "a split vote is tried again with no deadline: a split that never resolves hangs the publish",
        (
            "tests/celery/test_celery_enqueue_place.py::test_a_split_that_outlives_the_publish_window_is_refused_naming_every_vote",
        ),
        (
            Edit(
                "celery_redlock/celery/enqueue.py",
                "    return not name_masters(placed.votes, UNANSWERED) and time.monotonic() < deadline\n",
                "    return not name_masters(placed.votes, UNANSWERED)\n",
            ),
        ),
    ),
    Mutant(
        "aio_lost_link_leaves_its_votes_to_the_deadline",
        "a vote written on an asyncio link lost before its reply is not failed: it waits out the "
        "request timeout",
        (
            "tests/asyncio/test_async_faults.py::test_masters_killed_while_the_loop_was_busy_vote_error_at_once",
        ),
        (
            Edit(
                "celery_redlock/lock/aio/site.py",
                "            if entry.sink is not None:\n"
                "                entry.sink.put(entry.slot, failure)\n",
                "            if entry.sink is not None and entry.command is None:\n"
                "                entry.sink.put(entry.slot, failure)\n",
            ),
        ),
    ),
    Mutant(
        "remembered_interval_ignores_the_ttl",
        "a heartbeat interval checked for one TTL is taken for every TTL: a short lock kept at a "
        "long lock's interval expires under its holder",
        ("tests/core/test_heartbeat.py::test_an_interval_checked_for_one_ttl_is_not_taken_for_another",),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "        key = (redlock.request_timeout, redlock.drift_factor, lock.ttl, interval)\n",
                "        key = (redlock.request_timeout, redlock.drift_factor, interval)  # type: ignore\n",
            ),
        ),
    ),
    Mutant(
        "remembered_interval_takes_a_bool",
        "keep(interval=True) finds the 1.0 s remembered for its TTL and is kept at it, where a bool "
        "must be refused",
        ("tests/core/test_heartbeat.py::test_a_bad_interval_is_refused_every_time_whatever_was_remembered",),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "        if known is None or type(interval) not in _PLAIN_INTERVALS:\n",
                "        if known is None:\n",
            ),
        ),
    ),
    Mutant(
        "after_return_trusts_the_registry",
        "after_return releases only a run the held registry names: of two executions of one task "
        "id, the one whose entry the other replaced keeps its lock for ever",
        ("tests/review46/test_review46_reused_task_id.py",),
        (
            Edit(
                TASK,
                "            self._redlock_finish(status)\n        finally:\n",
                "            if task_id in registry._held:\n"
                "                self._redlock_finish(status)\n        finally:\n",
            ),
        ),
    ),
    Mutant(
        "replaced_heartbeat_thread_goes_on",
        "a heartbeat thread that keep() replaced after stop() goes on beating: two threads, and a "
        "stop that leaves one running",
        ("tests/review46/test_review46_stop_race.py",),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "        return not self._stopping and self._thread is thread\n",
                "        return not self._stopping\n",
            ),
        ),
    ),
    Mutant(
        "ttl_fast_path_skips_the_least",
        "a float TTL skips the check against min_ttl: a lock no round can honour is made, where its "
        "TTL must be refused",
        ("tests/core/test_lock_semantics.py::test_a_ttl_below_what_the_algorithm_can_honour_is_refused",),
        (
            Edit(
                SETTINGS,
                "        if type(value) is float and 0 < self.min_ttl <= value <= MAX_TTL:\n",
                "        if type(value) is float and value <= MAX_TTL:\n",
            ),
        ),
    ),
    Mutant(
        "ttl_fast_path_skips_the_most",
        "a float TTL skips the check against MAX_TTL: a TTL the servers cannot take is accepted",
        ("tests/core/test_seams_input.py::test_a_ttl_the_servers_cannot_take_is_refused_where_it_is_given",),
        (
            Edit(
                SETTINGS,
                "        if type(value) is float and 0 < self.min_ttl <= value <= MAX_TTL:\n",
                "        if type(value) is float and 0 < self.min_ttl <= value:\n",
            ),
        ),
    ),
    Mutant(
        "ttl_fast_path_trusts_min_ttl",
        "the fast path leans on min_ttl alone: with min_ttl set to 0 by hand a TTL of 0 or below is "
        "taken, where number() refuses it",
        (
            "tests/core/test_seams_input.py::"
            "test_a_float_ttl_is_refused_at_zero_and_below_whatever_min_ttl_was_set_to",
        ),
        (
            Edit(
                SETTINGS,
                "        if type(value) is float and 0 < self.min_ttl <= value <= MAX_TTL:\n",
                "        if type(value) is float and self.min_ttl <= value <= MAX_TTL:\n",
            ),
        ),
    ),
    Mutant(
        "replaced_thread_marks_successor_awake",
        "a heartbeat thread replaced by keep() wakes after its successor went to sleep and marks "
        "the heartbeat awake: keep() then never wakes the successor for an earlier lock",
        (
            "tests/review47/test_review47_heartbeat.py::test_a_replaced_thread_waking_late_does_not_hide_its_successors_sleep",
        ),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "        if self._thread is me:  # replaced, it must not mark its successor awake\n"
                "            self._sleep_until = 0.0\n",
                "        self._sleep_until = 0.0\n",
            ),
        ),
    ),
    Mutant(
        "rescheduled_entry_wakes_nobody",
        "a retry queued by a replaced heartbeat thread (or any push) wakes no sleeping thread: the "
        "successor sleeps past it and the lock expires",
        (
            "tests/review47/test_review47_heartbeat.py::"
            "test_a_lock_rescheduled_by_a_replaced_thread_is_still_extended[stop-and-keep]",
        ),
        (
            Edit(
                "celery_redlock/lock/heartbeat.py",
                "        if at < self._sleep_until:\n            self._cond.notify()\n",
                "",
            ),
        ),
    ),
)
