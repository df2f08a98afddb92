"""Operators' tools over a Redlock's masters: which locks are held and by whom, a stuck lock
freed by hand, and whether the masters are fit to hold locks. Knows nothing of Celery.

The ``celery redlock`` command prints what these return; an admin page can call them as they
are (``Redlock`` in, plain frozen dataclasses out). One module per concern, all importable
from here:

- inspect (:mod:`.lockview`): :func:`list_locks` (``ls``) and :func:`show` (``show``): every
  lock a quorum holds, one lock's per-master view, and who holds it;
- release (:mod:`.release`, :mod:`.liveness`): :func:`release` (``release``): free a stuck
  lock, without ``force`` only when :func:`liveness` shows its holder dead (see
  :mod:`.liveness` for the rule), by :func:`force_release`: the compare-and-delete of exactly
  the token that was shown;
- health (:mod:`.health`): :func:`health` (``health``): per master, reachable, round-trip time,
  version, role, persistence, eviction policy, clock offset against the others, and whether our
  commands and scripts run (ACL).

Every operation goes through the Redlock's own rounds (:class:`~.masters.Round`): one command
per master in parallel, by one deadline, so a dead master costs ``timeout`` once, never a hang.
"""

from __future__ import annotations

from .health import CLOCK_OFFSET_WARNING as CLOCK_OFFSET_WARNING
from .health import SAFE_EVICTION as SAFE_EVICTION
from .health import Finding as Finding
from .health import Health as Health
from .health import Level as Level
from .health import MasterHealth as MasterHealth
from .health import _clocks as _clocks
from .health import _info as _info
from .health import _master_health as _master_health
from .health import _ok as _ok
from .health import health as health
from .health import round_trips as round_trips
from .heartbeat import margin as margin
from .liveness import DEFAULT_WATCH as DEFAULT_WATCH
from .liveness import Liveness as Liveness
from .liveness import LivenessState as LivenessState
from .liveness import liveness as liveness
from .lockview import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from .lockview import INSPECT_BATCH as INSPECT_BATCH
from .lockview import MAX_SCAN_STEPS as MAX_SCAN_STEPS
from .lockview import SCAN_COUNT as SCAN_COUNT
from .lockview import SIBLING_SUFFIXES as SIBLING_SUFFIXES
from .lockview import TOKEN_HEX as TOKEN_HEX
from .lockview import Listing as Listing
from .lockview import LockKind as LockKind
from .lockview import LockView as LockView
from .lockview import MasterView as MasterView
from .lockview import list_locks as list_locks
from .lockview import show as show
from .release import Released as Released
from .release import ReleaseRefused as ReleaseRefused
from .release import force_release as force_release
from .release import logger as logger
from .release import operator_identity as operator_identity
from .release import release as release
