"""Every Lua script celery-redlock sends, in one place (acquire is a plain SET; see below).

User data only ever travels in KEYS and ARGV. Scripts are sent whole, with EVAL: the server finds
its compiled copy by digest, which measured no slower per call than EVALSHA (2.5-3 us either
way), and a script can never be missing, so a release sent without waiting for its reply cannot
fail with NOSCRIPT after a ``SCRIPT FLUSH``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Script:
    name: str
    source: str


# Acquire is not a script: a plain ``SET key token NX PX ttl`` is the cheapest grant a master can
# give (a script costs each master ~10 us more per try, which a contended loop pays on every
# attempt). A fenced acquire would replace that one command, built in Redlock.try_acquire, with a
# script returning {granted, counter}: still one command per master, still one round trip.

# RELEASE (compare-and-delete, then tell the waiters)
#   KEYS[1]  the lock key; also the channel the deletion is published on
#   ARGV[1]  the token that must hold it
#   returns  1 if the key held ARGV[1] and was deleted, 0 if it was absent or held another token
# The PUBLISH runs in the same atomic step as the DEL, so a waiter subscribed to the key before its
# attempt hears of every deletion after it (see subscriber.py). Only a deletion publishes; with
# nobody subscribed a PUBLISH is one dictionary lookup on the master.
RELEASE = Script(
    "release",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', KEYS[1], '*')
    return 1
end
return 0
""",
)

# EXTEND (compare-and-pexpire)
#   KEYS[1]  the lock key
#   ARGV[1]  the token that must hold it
#   ARGV[2]  the new ttl in milliseconds; it replaces the remaining one
#   returns  1 if the key held ARGV[1] and its ttl was set, 0 otherwise
# An expired key reads as absent, so an extension can never bring a lock back to life, and a key
# that another token took in the meantime is left alone.
EXTEND = Script(
    "extend",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
""",
)
