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
#            lock runs out, so the waiter can wake then instead of a fallback poll later; error
#            REDLOCK_KIND if a reentrant lock (a hash) holds it, which no wait would change
ACQUIRE_WAIT = Script(
    "acquire_wait",
    """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.status_reply('OK')
end
if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    return redis.error_reply('REDLOCK_KIND ' .. KEYS[1] .. ' is held as a reentrant lock')
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


# -- fair locks (see fair.py) ---------------------------------------------------------------------
# The lock key is a plain string, as for a plain lock (so the two exclude each other, and plain
# EXTEND keeps a fair lock alive). Beside it, KEYS[2] is the queue, a ZSET member -> ticket, and
# KEYS[3] the entries' deadlines, a ZSET member -> deadline in ms on this master's clock. Equal
# tickets sort by member, the same way on every master. Only the head may take a free lock.

# FAIR_ACQUIRE (one attempt of a fair waiter)
#   KEYS[1]  the lock key; KEYS[2] its queue; KEYS[3] its deadlines
#   ARGV[1]  the attempt's token
#   ARGV[2]  the ttl in milliseconds
#   ARGV[3]  the waiter's member (one per acquire call)
#   ARGV[4]  the waiter's ticket (unused by 'probe')
#   ARGV[5]  the entry's ttl in milliseconds: it is dropped this long after its last attempt
#   ARGV[6]  'probe' (take the lock only if it is free and nobody queues; never queue),
#            'join' (queue at the ticket, or move there), 'keep' (refresh the entry if it is
#            still queued; never queue again: an entry that expired has lost its place)
#   returns  +OK if the lock is now ARGV[1]'s; else {pttl of the lock (-2: free), the next
#            ticket (highest queued + 1), the member's rank (-1: not queued), 1 if the member
#            was queued before this call else 0}; error REDLOCK_KIND if a reentrant lock holds it
# Each call first drops at most 32 expired entries, so its cost stays bounded: a dead waiter's
# entry is gone at most one attempt after its deadline.
FAIR_ACQUIRE = Script(
    "fair_acquire",
    """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'hash' then
    return redis.error_reply('REDLOCK_KIND ' .. KEYS[1] .. ' is held as a reentrant lock')
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 32)
if #expired > 0 then
    redis.call('ZREM', KEYS[2], unpack(expired))
    redis.call('ZREM', KEYS[3], unpack(expired))
end
local member = ARGV[3]
local queued = redis.call('ZSCORE', KEYS[2], member) and 1 or 0
local mode = ARGV[6]
if mode == 'join' then
    redis.call('ZADD', KEYS[2], ARGV[4], member)
end
if mode == 'join' or (mode == 'keep' and queued == 1) then
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), member)
end
if kind == 'none' then
    local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
    if head == member or (head == nil and mode == 'probe') then
        redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
        return redis.status_reply('OK')
    end
end
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local after = 1
if last[2] then
    after = tonumber(last[2]) + 1
end
return {redis.call('PTTL', KEYS[1]), after, redis.call('ZRANK', KEYS[2], member) or -1, queued}
""",
)

# FAIR_RELEASE (a release, a failed attempt's retraction, or a waiter leaving the queue)
#   KEYS[1]  the lock key, also the channel; KEYS[2] its queue; KEYS[3] its deadlines
#   ARGV[1]  the token to compare-and-delete ('' to delete nothing)
#   ARGV[2]  the waiter's member
#   ARGV[3]  '1' to take the member out of the queue, '0' to keep its place (a retraction)
#   returns  1 if the lock held ARGV[1] and was deleted, else 0
# When this freed the lock or changed the queue and the lock is free, the new head's member (or
# '*' when nobody queues) is published: only that waiter wakes, not the herd.
FAIR_RELEASE = Script(
    "fair_release",
    """
local deleted = 0
if ARGV[1] ~= '' and redis.call('TYPE', KEYS[1]).ok == 'string'
        and redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
    deleted = 1
end
local left = 0
if ARGV[3] == '1' then
    left = redis.call('ZREM', KEYS[2], ARGV[2])
    redis.call('ZREM', KEYS[3], ARGV[2])
end
if (deleted == 1 or left == 1) and redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('PUBLISH', KEYS[1], redis.call('ZRANGE', KEYS[2], 0, 0)[1] or '*')
end
return deleted
""",
)
