"""The Redlock algorithm over N independent Redis masters. Imports nothing of Celery.

- :mod:`.masters`: the masters and the one fan-out primitive every operation goes through;
- :mod:`.wire`: RESP packing and parsing for that fan-out;
- :mod:`.scripts`: every Lua script, with its KEYS, ARGV and return value;
- :mod:`.redlock`: acquire, extend and release, counting votes and validity;
- :mod:`.heartbeat`: the per-process thread that keeps held locks alive;
- :mod:`.linger`: releases that travel with the process's next round.
"""
