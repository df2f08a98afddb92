"""The Redlock algorithm over N independent Redis masters. Imports nothing of Celery.

- :mod:`.masters`: the masters and the one fan-out primitive every operation goes through;
- :mod:`.wire`: RESP packing and parsing for that fan-out;
- :mod:`.scripts`: every Lua script, with its KEYS, ARGV and return value;
- :mod:`.redlock`: the Redlock: rounds of acquire, extend and release, and validity;
- :mod:`.tally`: outcomes to votes to a decision, and the retraction rule, for every kind;
- :mod:`.resource`: one resource's :class:`Lock`, what a Redlock's rounds decided for it;
- :mod:`.commands`: what each kind of lock sends (plain, waiting, reentrant);
- :mod:`.reentrant` and :mod:`.owner`: locks the holding execution context may take again;
- :mod:`.subscriber`: waiting woken by the release (one listening link per master);
- :mod:`.waiting`: which poll the core waits on its sockets with (plain or green);
- :mod:`.heartbeat`: the per-process thread that keeps held locks alive;
- :mod:`.admin`: the operators' tools over the same rounds: :mod:`.lockview` (list, show),
  :mod:`.release` (force-release, and the release that never breaks a live holder, with
  :mod:`.liveness`) and :mod:`.health` (master health).
"""
