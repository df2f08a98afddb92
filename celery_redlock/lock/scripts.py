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

# ACQUIRE_WAIT (a waiting acquirer's later attempts; the first stays a plain SET, see above)
#   KEYS[1]  the lock key
#   ARGV[1]  the token
#   ARGV[2]  the ttl in milliseconds
#   returns  +OK if the key was set (as SET NX PX answers), else the key's PTTL: when the holder's
#            lock runs out, so the waiter can wake then instead of a fallback poll later
ACQUIRE_WAIT = Script(
    "acquire_wait",
    """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.status_reply('OK')
end
return redis.call('PTTL', KEYS[1])
""",
)

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


# -- reentrant locks (see reentrant.py) -----------------------------------------------------------
# The key is a hash {token: count}: the seed document's owner -> count, with the owner stood for
# on the masters by its acquisition's token (unique per acquisition; the owner's id never leaves
# the process). The depth lives on the client; the counts are its mirror for operators. Every
# script checks the key's type first: a plain lock's string gets a clear error, never WRONGTYPE.
_KIND_ERROR = "return redis.error_reply('REDLOCK_KIND ' .. KEYS[1] .. ' is held as a plain lock')"

# R_ACQUIRE (first acquisition by an owner)
#   KEYS[1]  the lock key
#   ARGV[1]  the acquisition's token
#   ARGV[2]  the ttl in milliseconds
#   returns  +OK if the key was absent and is now {token: 1} with the ttl; the key's PTTL (an
#            integer) if a reentrant lock holds it; error REDLOCK_KIND if a plain lock holds it
R_ACQUIRE = Script(
    "r_acquire",
    f"""
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then
    redis.call('HSET', KEYS[1], ARGV[1], 1)
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return redis.status_reply('OK')
end
if kind == 'hash' then
    return redis.call('PTTL', KEYS[1])
end
{_KIND_ERROR}
""",
)

# R_ENTER (re-entry by the owner that holds it)
#   KEYS[1]  the lock key
#   ARGV[1]  the holding's token
#   ARGV[2]  the ttl in milliseconds (the holding's)
#   returns  the new count (>= 2) if the token holds the key, its ttl then reset; 0 if not (gone,
#            or another token's); error REDLOCK_KIND if a plain lock holds it. Never creates it.
R_ENTER = Script(
    "r_enter",
    f"""
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'hash' then
    if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
        local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return count
    end
    return 0
end
if kind == 'none' then
    return 0
end
{_KIND_ERROR}
""",
)

# R_EXIT (an inner exit: the owner still holds it)
#   KEYS[1]  the lock key
#   ARGV[1]  the holding's token
#   returns  1 if the token's count was above 1 and is now one less, else 0. Never deletes: only
#            the final exit (R_RELEASE) frees the lock, so a count that drifted on one master
#            (a late re-entry) can neither free it early nor keep it after the last exit.
R_EXIT = Script(
    "r_exit",
    """
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    local count = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
    if count and count > 1 then
        redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
        return 1
    end
end
return 0
""",
)

# R_RELEASE (the final exit)
#   KEYS[1]  the lock key; also the channel the deletion is published on (as RELEASE)
#   ARGV[1]  the holding's token
#   returns  1 if the token held the key, which is deleted whatever its count; else 0
R_RELEASE = Script(
    "r_release",
    """
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', KEYS[1], '*')
    return 1
end
return 0
""",
)

# R_EXTEND (compare-and-pexpire of a reentrant lock)
#   KEYS[1]  the lock key
#   ARGV[1]  the holding's token
#   ARGV[2]  the new ttl in milliseconds
#   returns  1 if the token holds the key and its ttl was set, else 0
R_EXTEND = Script(
    "r_extend",
    """
if redis.call('TYPE', KEYS[1]).ok == 'hash' and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
""",
)
