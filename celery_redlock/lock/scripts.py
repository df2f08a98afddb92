"""Every Lua script celery-redlock sends, in one place (acquire is a plain SET; see below).

User data only ever travels in KEYS and ARGV. **One policy for every script: by digest, the
source only where it is missing.** Each script command is built by
``transport.commands.script_template`` as ``EVALSHA <sha1> ...``: 40 bytes instead of the source
(a release 137 bytes instead of 239, a fair acquire 411 instead of 1987; no slower on loopback).
A master that answers NOSCRIPT ran nothing (restarted, ``SCRIPT FLUSH``): the transport, not the
caller, sends it the ``EVAL`` form of the same command (found through the registry in ``script.py``) on the
same link by the same deadline; the caller sees only the script's reply.

A reply nobody waits for (a release whose quorum answered, a retraction) cannot be resent by the
fast transport once it reads it later: a NOSCRIPT there is a release that did not happen (the key
lives out its TTL), logged at WARNING naming the master. So every new link loads every script
(``SCRIPT LOAD``, in its handshake's one write): only a ``SCRIPT FLUSH`` under a live link opens
that gap, until each script's next EVAL there.
"""

from __future__ import annotations

from .script import Script as Script
from .script import by_digest as by_digest
from .script import for_masters as for_masters

# Acquire is not a script: a plain ``SET key token NX PX ttl`` is the cheapest grant a master can
# give (a script costs each master ~10 us more per try, paid on every contended attempt).

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
    -- The queue outlives its newest entry, never more: a name nobody waits on any longer
    -- leaves no key behind, whatever its waiters did (killed, paused, partitioned away).
    if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[5]) then
        redis.call('PEXPIRE', KEYS[2], ARGV[5])
        redis.call('PEXPIRE', KEYS[3], ARGV[5])
    end
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


# -- fenced locks (see fencing.py) ----------------------------------------------------------------
# Beside the lock key, KEYS[2] (<lock key>~fence) is this master's fence counter for the name: a
# decimal integer, never lowered. Fences are microseconds-scale integers (~1.7e15 < 2^53), which
# Lua's doubles hold exactly; Lua never formats one (Lua 5.1 would print 1.7e+15): the client does.

# FENCED_ACQUIRE (a fenced lock's attempt; still one command per master)
#   KEYS[1]  the lock key
#   KEYS[2]  its fence counter
#   ARGV[1]  the token
#   ARGV[2]  the ttl in milliseconds
#   returns  if the lock key exists (refused, nothing written), -1 - its PTTL in ms: an integer
#            <= 0 (a waiter wakes when the holder's lock runs out); else, the key now set,
#            max(counter, this master's clock in microseconds): an integer > 0. The clock is the
#            floor that keeps fences growing across a master that restarted without its counter.
# SET comes before TIME: no write follows a non-deterministic command (scripts before Redis 5).
FENCED_ACQUIRE = Script(
    "fenced_acquire",
    """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return -1 - redis.call('PTTL', KEYS[1])
end
local time = redis.call('TIME')
local c = tonumber(time[1]) * 1000000 + tonumber(time[2])
local stored = tonumber(redis.call('GET', KEYS[2]) or '0')
if stored == nil then
    return redis.error_reply('ERR fence counter ' .. KEYS[2] .. ' is not an integer')
end
if stored > c then
    c = stored
end
return c
""",
)

# FENCE_WRITE_BACK (record the grant's fence, but only while the lock is still the grant's)
#   KEYS[1]  the lock key
#   KEYS[2]  its fence counter
#   ARGV[1]  the token that must hold KEYS[1]
#   ARGV[2]  the fence, in decimal
#   ARGV[3]  the counter's retention in milliseconds
#   returns  1 if KEYS[1] holds ARGV[1] and the counter is now >= ARGV[2] (its retention
#            renewed); 0 if KEYS[1] is absent or another token's (nothing written)
# The token check is what lets a late write-back run harmlessly: after our interval on this
# master it is a no-op, inside it it only raises the counter.
FENCE_WRITE_BACK = Script(
    "fence_write_back",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
local stored = tonumber(redis.call('GET', KEYS[2]) or '0')
if stored == nil or stored < tonumber(ARGV[2]) then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
else
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
""",
)


# -- fenced resources (celery_redlock/fenced.py; sent to a data server, never to a lock master) ----
# A Redis key guarded by fences: KEYS[1] the data key, KEYS[2] the highest fence it has seen. A
# fence is compared as a number and stored as the client wrote it.

# FENCED_READ (claim the key for a fence, then read it)
#   KEYS[1]  the data key
#   KEYS[2]  its fence key
#   ARGV[1]  the fence, in decimal
#   returns  {1, value} (value false when the key is absent) after raising the stored fence to
#            ARGV[1]; {0, stored fence} if a higher fence has been seen (nothing written)
FENCED_READ = Script(
    "fenced_read",
    """
local stored = redis.call('GET', KEYS[2])
if stored and tonumber(stored) > tonumber(ARGV[1]) then
    return {0, stored}
end
redis.call('SET', KEYS[2], ARGV[1])
return {1, redis.call('GET', KEYS[1])}
""",
    on_masters=False,
)

# FENCED_WRITE (write the key under a fence)
#   KEYS[1]  the data key
#   KEYS[2]  its fence key
#   ARGV[1]  the fence, in decimal
#   ARGV[2]  the value
#   ARGV[3]  the value's ttl in milliseconds, or '0' for none
#   returns  {1} after setting the value and the fence; {0, stored fence} if a higher fence has
#            been seen (nothing written)
FENCED_WRITE = Script(
    "fenced_write",
    """
local stored = redis.call('GET', KEYS[2])
if stored and tonumber(stored) > tonumber(ARGV[1]) then
    return {0, stored}
end
redis.call('SET', KEYS[2], ARGV[1])
if ARGV[3] == '0' then
    redis.call('SET', KEYS[1], ARGV[2])
else
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return {1}
""",
    on_masters=False,
)


# -- operations (admin.py) ------------------------------------------------------------------------
# Read-only but for the health probe's own throwaway key; run only by the operators' tools, never
# on a lock's path. Release by an operator sends RELEASE / R_RELEASE above, by the exact token.

# INSPECT (what one master holds under a lock key, in one atomic look)
#   KEYS[1]  the lock key
#   KEYS[2]  its fair-lock queue (``<lock key>~queue``, a ZSET while anyone waits in it)
#   returns  {type, pttl, queue length, ...}: type is TYPE's answer ('none', 'string', 'hash',
#            ...); pttl is PTTL's (-2 absent, -1 no TTL); queue length is the ZCARD of KEYS[2] (0
#            when it is no ZSET); then, for a string, its value; for a hash, its fields and values
#            in turn ({token, count, ...}: a reentrant lock); for any other type, nothing
INSPECT = Script(
    "inspect",
    """
local kind = redis.call('TYPE', KEYS[1]).ok
local queued = 0
if redis.call('TYPE', KEYS[2]).ok == 'zset' then
    queued = redis.call('ZCARD', KEYS[2])
end
local out = {kind, redis.call('PTTL', KEYS[1]), queued}
if kind == 'string' then
    out[4] = redis.call('GET', KEYS[1])
elseif kind == 'hash' then
    local fields = redis.call('HGETALL', KEYS[1])
    for i = 1, #fields do
        out[3 + i] = fields[i]
    end
end
return out
""",
)


# -- enqueue markers (celery/enqueue) -------------------------------------------------------------
# A task with ``lock_enqueue`` takes its lock key when it is published, as a *marker*: a plain lock
# value (``<token>|<holder>``, the holder naming the queued task) set with PLACE. The message
# carries the marker's value; its run takes the key over with HANDOVER, and a run that
# re-published itself (``self.retry()``) gives the key back to the new message's marker with
# REQUEUE. Each swaps one holder's value for the other's in one step on each master: there is no
# moment at which a master holds neither (no gap), and a run is never refused by its own marker.
#
# A marker belongs to the task that placed it. When another task (or any other holder) has the
# lock key, a publish sets its marker *beside* it, on a key of its own task (BESIDE; the "side
# key", see markers.side_key): it is deduplicated against that, and its run waits for the lock
# key as any contender does, and takes it with HANDOVER, which deletes the side marker in the
# same step (an attempt no quorum granted puts it back: HANDOVER_RETRACT). On each master a
# task's marker is on the lock key or on its side key, never both: PLACE refuses while the side
# key is set, and BESIDE only sets it while the lock key holds the very value of another holder
# its publisher read.

# PLACE (a publish takes the lock key as its marker, unless its task already waits beside it)
#   KEYS[1]  the lock key
#   KEYS[2]  the publishing task's side key
#   ARGV[1]  the marker's value
#   ARGV[2]  the ttl in milliseconds
#   returns  +OK if neither key was set and the lock key now holds ARGV[1] with the ttl; else
#            {1, the side key's value} (the task's own marker waits beside the key); else
#            {2, the lock key's value} ('' when it is not a string: a reentrant lock's hash)
PLACE = Script(
    "place",
    """
local beside = redis.call('GET', KEYS[2])
if beside then
    return {1, beside}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.status_reply('OK')
end
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then
    return {2, ''}
end
return {2, redis.call('GET', KEYS[1])}
""",
)

# BESIDE (a publish sets its marker on its task's side key: another holder has the lock key)
#   KEYS[1]  the publishing task's side key
#   KEYS[2]  the lock key
#   ARGV[1]  the marker's value
#   ARGV[2]  the ttl in milliseconds
#   ARGV[3]  the lock key's value the publisher read (PLACE's answer: another task's, or '')
#   returns  +OK if the side key was free and now holds ARGV[1] with the ttl; {1, the side key's
#            value} if the task's own marker is there; 0 if the lock key no longer holds ARGV[3]
#            (freed, or taken by someone else since: the publisher starts over with PLACE)
# Compared on the whole value: had the lock key become this task's own marker or run since it was
# read, the side key would be refused, so the task never has two markers queued.
BESIDE = Script(
    "beside",
    """
local beside = redis.call('GET', KEYS[1])
if beside then
    return {1, beside}
end
local kind = redis.call('TYPE', KEYS[2]).ok
if kind == 'none' or (kind == 'string' and redis.call('GET', KEYS[2]) ~= ARGV[3]) then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.status_reply('OK')
""",
)

# HANDOVER (a run takes its key: free, or held by the marker its own message carries)
#   KEYS[1]  the lock key
#   KEYS[2]  (optional) the task's side key, where its marker waits when it was set beside
#   ARGV[1]  the run's token (the value it holds the key by from now on)
#   ARGV[2]  the ttl in milliseconds
#   ARGV[3]  the marker's value, as the message carries it (as placed)
#   ARGV[4]  its published form, which markers.keep swaps in once the publish returned (either)
#   returns  +OK if the key was absent or held ARGV[3] or ARGV[4], and now holds ARGV[1] with the
#            ttl (as SET NX PX answers), the side key's marker (either form) deleted in the same
#            step; else the key's PTTL, as ACQUIRE_WAIT answers a refusal
# Compared on the marker's whole value, never on the task id: a redelivered copy of a message
# whose run already took the key over finds the run's token there, and waits like any contender.
HANDOVER = Script(
    "handover",
    """
local held = redis.pcall('GET', KEYS[1])  -- a reentrant lock's hash: an error value, refused
if held == false or held == ARGV[3] or held == ARGV[4] then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    local beside = KEYS[2] and redis.call('GET', KEYS[2])
    if beside and (beside == ARGV[3] or beside == ARGV[4]) then
        redis.call('DEL', KEYS[2])
    end
    return redis.status_reply('OK')
end
return redis.call('PTTL', KEYS[1])
""",
)

# HANDOVER_RETRACT (a failed HANDOVER attempt gives its marker back, see markers.HandoverLock)
#   KEYS[1]  the lock key
#   KEYS[2]  the task's side key
#   ARGV[1]  the attempt's token
#   ARGV[2]  the marker's value
#   ARGV[3]  the marker's ttl left in milliseconds (0: it is over, nothing is put back)
#   returns  1 if the key held ARGV[1] (deleted, and the marker set beside it unless the side key
#            is taken), else 0 (the attempt did not take the key here: nothing to give back)
# An attempt that took the key on a minority of masters replaced the marker there (on the lock key,
# or beside it: HANDOVER deleted it); a plain release would leave the message unmarked on those
# masters, and a few such attempts leave no quorum marked, so a duplicate publish is accepted. The
# marker goes back beside the key, wherever it was: there it answers its task's publishes as
# before, and blocks no other holder's lock should its run never come back for it.
HANDOVER_RETRACT = Script(
    "handover_retract",
    """
if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
if tonumber(ARGV[3]) > 0 then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3], 'NX')
end
return 1
""",
)

# HANDOVER_TIDY (a run took its key over on a quorum; sent to every master that did not grant)
#   KEYS[1]  the lock key; also the channel a deletion of it is published on
#   KEYS[2]  the task's side key
#   ARGV[1]  the run's token; ARGV[2] the marker's value as placed; ARGV[3] its published form
#   returns  how many of the two keys it deleted: each one that held the token or the marker
# Where the HANDOVER was refused (another holder) or not answered, a copy of the marker is left
# that names a message already running; copies on a minority split every later publish of the
# task (PLACE: its own marker there, free elsewhere) for the marker's TTL. A late HANDOVER's token
# goes too. GET by pcall: a reentrant lock's hash is an error value, equal to nothing.
HANDOVER_TIDY = Script(
    "handover_tidy",
    """
local deleted = 0
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] or held == ARGV[2] or held == ARGV[3] then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', KEYS[1], '*')
    deleted = 1
end
local beside = redis.call('GET', KEYS[2])
if beside == ARGV[2] or beside == ARGV[3] then
    deleted = deleted + redis.call('DEL', KEYS[2])
end
return deleted
""",
)

# REQUEUE (a run gives its key back to the marker of the message it re-published itself as)
#   KEYS[1]  the lock key; also the channel the swap is published on
#   ARGV[1]  the run's token
#   ARGV[2]  the new marker's value
#   ARGV[3]  the marker's ttl in milliseconds
#   returns  1 if the key held ARGV[1] and now holds ARGV[2] with the ttl, else 0
# The PUBLISH wakes the re-published copy if it is already waiting (lock_contended="wait") for
# the key its marker now holds; any other waiter wakes, is refused, and sleeps again.
REQUEUE = Script(
    "requeue",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
    redis.call('PUBLISH', KEYS[1], '*')
    return 1
end
return 0
""",
)
