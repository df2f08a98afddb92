"""Every Lua script celery-redlock sends, in one place.

User data only ever travels in KEYS and ARGV. Scripts are loaded once per connection (SCRIPT LOAD
at connect) and called by EVALSHA; a NOSCRIPT reply (the server flushed its script cache) falls
back to EVAL on the same connection.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# ACQUIRE
#   KEYS[1]  the lock key
#   ARGV[1]  this acquisition's token
#   ARGV[2]  ttl in milliseconds
#   returns  {1, 0}        set: the key was free and now holds ARGV[1] for ARGV[2] ms
#            {0, pttl}     not set: another token holds it, expiring in pttl ms
# An array reply leaves room for a fencing counter in the second field of a grant, without a
# second round trip.
ACQUIRE = Script("acquire", """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return {1, 0}
end
return {0, redis.call('PTTL', KEYS[1])}
""")

# RELEASE (compare-and-delete)
#   KEYS[1]  the lock key
#   ARGV[1]  the token that must hold it
#   returns  1 if the key held ARGV[1] and was deleted, 0 if it was absent or held another token
RELEASE = Script("release", """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
""")

# EXTEND (compare-and-pexpire)
#   KEYS[1]  the lock key
#   ARGV[1]  the token that must hold it
#   ARGV[2]  the new ttl in milliseconds; it replaces the remaining one
#   returns  1 if the key held ARGV[1] and its ttl was set, 0 otherwise
# An expired key reads as absent, so an extension can never bring a lock back to life, and a key
# that another token took in the meantime is left alone.
EXTEND = Script("extend", """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
""")

ALL: tuple[Script, ...] = (ACQUIRE, RELEASE, EXTEND)
