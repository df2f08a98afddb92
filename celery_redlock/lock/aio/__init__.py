"""The Redlock algorithm for asyncio: :class:`AsyncRedlock` and its locks.

Shares the rounds (:mod:`..rounds`), the settings (:mod:`..settings`), the held-lock state
(:mod:`..state`), the scripts, commands, tally and server-identity rules with the threaded
``Redlock``; adds an asyncio transport (:mod:`.exchange`, :mod:`.site`, :mod:`.link`,
:mod:`.handshake`) and the asyncio locks (:mod:`.lock`, :mod:`.reentrant`).
"""

from __future__ import annotations

from .lock import AsyncLock
from .redlock import AsyncRedlock
from .reentrant import AsyncReentrantLock

__all__ = ["AsyncLock", "AsyncRedlock", "AsyncReentrantLock"]
