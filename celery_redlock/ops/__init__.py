"""The operators' commands, one implementation for both front ends: ``celery -A proj redlock
...`` (:mod:`celery_redlock.celery.command`, the masters from the app's settings) and the
standalone ``celery-redlock ...`` (:mod:`.standalone`, the masters from ``--masters`` or
``CELERY_REDLOCK_MASTERS``, no Celery app).

- :mod:`.commands`: what each of ``ls``, ``show``, ``release``, ``health``, ``leader`` does and
  prints, and its exit status (:mod:`.views`: the tables); they print through :mod:`.output`,
  the only writer;
- :mod:`.cli`: the click commands built over a :class:`~.cli.Frontend` (where the masters come
  from), so both front ends share options, help, confirmation and exit codes;
- :mod:`.standalone`: the front end whose masters come from ``--masters`` or the environment;
- :mod:`.exits`: the exit statuses, the same for every command of both front ends;
- :mod:`.leader`: the beat leader record, read by ``leader`` and written by the HA beat.

Below the Celery layer: nothing here imports Celery, and the lock's rounds do the talking to the
masters (:mod:`celery_redlock.lock.admin`). See docs/cli.md.
"""
