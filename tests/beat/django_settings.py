"""The Django settings of the django-celery-beat tests, for the beat processes and the test process.

The beat processes load it as ``DJANGO_SETTINGS_MODULE=tests.beat.django_settings`` (Celery's
Django fixup then calls ``django.setup()`` before the scheduler is imported, as in any Django
project); the test process passes :func:`settings_for` to ``settings.configure()``, so that no
``DJANGO_SETTINGS_MODULE`` leaks into the other processes the suite starts. The database is the
one the test session created, named by ``BEAT_TEST_PG_DB``.
"""

from __future__ import annotations

import os
from typing import Any

PG_HOST = "127.0.0.1"
PG_PORT = 5432
PG_USER = "postgres"


def settings_for(database: str) -> dict[str, Any]:
    """Django settings over the PostgreSQL database ``database`` (trust auth on loopback)."""
    return {
        "DATABASES": {
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": database,
                "USER": PG_USER,
                "HOST": PG_HOST,
                "PORT": str(PG_PORT),
                "CONN_MAX_AGE": 0,
            }
        },
        "INSTALLED_APPS": ["django_celery_beat"],
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "SECRET_KEY": "celery-redlock tests only",
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
    }


globals().update(settings_for(os.environ.get("BEAT_TEST_PG_DB", "postgres")))

# The Celery settings of a Django project, read by app.config_from_object("django.conf:settings",
# namespace="CELERY"); docs/beat.md's django-celery-beat snippet is an excerpt of these lines, and
# the beats of test_beat_django.py run with them (celery_settings() below).
CELERY_BEAT_SCHEDULER = "celery_redlock.beat:RedlockScheduler"
CELERY_REDLOCK_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"


def celery_settings() -> dict[str, Any]:
    """The ``CELERY_*`` settings above under Celery's own names, as the namespace reads them."""
    return {
        name.removeprefix("CELERY_").lower(): value
        for name, value in globals().items()
        if name.startswith("CELERY_")
    }
