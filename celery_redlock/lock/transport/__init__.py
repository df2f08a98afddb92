"""The fast transport: the N masters and the one fan-out primitive every Redlock operation goes
through.

One idea per module: :mod:`.commands` (what travels: a command, an outcome per master),
:mod:`.link` (one connection, driven without blocking), :mod:`.handshake` (what a new link
says first and learns), :mod:`.master` (a master's links, connects, backoff and kept commands),
:mod:`.linkset` (the links a clean round parks), :mod:`.identity` (one server never votes
twice) and :mod:`.round` (one operation's fan-out); the bytes are :mod:`..wire`'s and the
poll is :mod:`..waiting`'s.


A :class:`Round` takes one connection ("link") per master, writes a command to every link, then
reads every reply against one shared deadline: N masters cost one round trip, and a dead or
paused master costs at most ``request_timeout``, never a hang and never a hidden retry.

Ordering is what keeps a lock from being left behind. A link whose reply did not arrive in time
is not closed: it is marked as owing that reply, and any follow-up for the same key (the release
after a failed acquire, or the retraction of a late vote) is written to that *same* link, so the
master executes it after the late command. A link that owes replies is drained before it is
reused and is never handed to another operation while it still owes them.

A release is a ``call`` whose replies are waited for (``keep``: what could not be written is
kept for the master's next link). What nobody waits for (a retraction, an inner reentrant exit,
``release_without_waiting``) is *sent*: its replies are owed on time, not late, and are read and
skipped by the link's next use, before that use's own reply.

Links are opened by redis-py (name resolution, TCP, TLS) and then driven here, non-blocking,
through :mod:`.wire`: one ``send`` per master, one ``poll`` for all of them, one ``recv`` per
reply, and nothing hidden in between (the poll is :mod:`.waiting`'s: ``select.poll`` itself,
or its stand-in under eventlet). The handshake is ours: AUTH, CLIENT SETNAME, SELECT,
``INFO server`` and a ``SCRIPT LOAD`` of every script pipelined in one write, so a new link costs
one round trip after the TCP (and TLS) handshake, tells which server it reached (its
``run_id``), and leaves the master with every script a round sends it by digest.

The connect path, and its words:

- A round costs one ``request_timeout`` at most, connects included. A link that no idle stack
  can give is *connected* on a daemon thread of its own (name resolution too: ``getaddrinfo``
  has no timeout, so it never runs on a round's path); the round's first command waits for it by
  that command's own deadline and goes out on it as soon as it is there. A connect still under
  way at the deadline goes on: its link is *fresh*, kept for a later round. No pool is shared:
  a connect that hangs holds up its own master only, and never the exit of the process.
- A master whose connect is still under way past its deadline (a hung name lookup or TCP/TLS
  handshake) begins no other until it ends, nor more than ``MAX_CONNECTS`` at once: its rounds
  vote ``error`` ("connecting") at once.
- An idle link is *checked* before it carries anything: one ``poll(0)`` over all the round's
  links, no round trip, tells a link whose owed replies have arrived (they are left to be read
  with its next reply) from one the master closed while it sat idle (its ``timeout``,
  ``CLIENT KILL``, a restart), which is dropped and replaced within the round: a vote or a
  release written to it would be lost.
- A master whose connect failed is *down*: rounds vote ``error`` for it at once, and its
  connect is retried on a timer thread of its own, after a *backoff* doubling from
  ``BACKOFF_FLOOR`` to ``BACKOFF_CAP``, until one succeeds: the master is up again with that
  retry's fresh link, within ``BACKOFF_CAP`` of its return whether rounds come meanwhile or not.
- A command nobody waits for (a release, carried releases) that a round could not write to a
  master (down, its connect not done by the deadline, a failed write) is *kept* on the master
  and written first on its next new link, or by a delivery task (see ``MAX_UNSENT``): never
  dropped. A round with no idle link always begins its own connect, however many are under way.
- A round that ends cleanly (every master has a link, none late) leaves its links *parked* as
  one :class:`LinkSet`, and the next round takes the set whole: one pop and one ``poll(0)``
  where five idle stacks would cost a loop over the masters to take, check and give back. A set
  is trusted only in the process and the master generation it was parked in (see LinkSet).
- Every new link is *identified* before it carries anything: a server whose ``run_id``
  another master of the round already has is one server reached twice (a proxy, an alias, one
  of its other databases). Both masters are then *refused*: their links are closed, and every
  later call raises ``ConfigError`` naming both, so one server never casts two votes.
- A server that is no Redis master of its own (not RESP; a cluster node, a Sentinel or a replica
  by its handshake) is *unfit*: that master alone is refused for the Redlock's life (never
  contacted again, reported at WARNING) and votes ``error`` saying what it is. One that may be
  out only for a while (silent, a host name that does not resolve) is reported, but only down.
"""
