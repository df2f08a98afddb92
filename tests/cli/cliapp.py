"""A Celery app with no tasks, only the settings `celery -A cliapp redlock ...` reads: the masters
from the environment, as the standalone CLI's come from --masters."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("cliapp")
app.conf.redlock_masters = os.environ["CLIAPP_MASTERS"].split(",")
app.conf.redlock_request_timeout = float(os.environ.get("CLIAPP_REQUEST_TIMEOUT") or 0.1)
app.conf.redlock_key_prefix = os.environ.get("CLIAPP_KEY_PREFIX", "redlock:")
