"""The Redlock algorithm for asyncio: :class:`AsyncRedlock` and its locks.

Shares the rounds (:mod:`..rounds`), the settings (:mod:`..settings`), the held-lock state
(:mod:`..state`), the scripts, commands, tally and server-identity rules with the threaded
``Redlock``; adds an asyncio transport (:mod:`.exchange`, :mod:`.site`, :mod:`.link`,
:mod:`.handshake`), waiting woken by the release (:mod:`.subscriber`, over :mod:`..rooms`' rules)
and the asyncio locks (:mod:`.lock`, :mod:`.fair`, :mod:`.reentrant`).
"""

from __future__ import annotations

from .fair import AsyncFairLock
from .lock import AsyncLock
from .redlock import AsyncRedlock
from .reentrant import AsyncReentrantLock

__all__ = ["AsyncFairLock", "AsyncLock", "AsyncRedlock", "AsyncReentrantLock"]
