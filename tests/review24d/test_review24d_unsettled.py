"""``queued_task_id`` over a marker that the answering masters show only as placed (its publish
not yet returned, as far as they know) while a silent master holds it published: real masters,
the marker the library's own (a real publish to a queue nobody consumes), its forms set per
master as a keep() that reached some masters leaves them."""

from __future__ import annotations

from typing import Any

import pytest

from celery_redlock import MastersUnavailable
from celery_redlock.celery.settings import app_settings_and_redlock
from celery_redlock.lock.resource import lock_key

from .conftest import World


@pytest.mark.timeout(30)
def test_a_marker_published_on_a_silent_master_is_not_read_as_not_queued(
    r24d: Any, world: World, tag: str
) -> None:
    """Three masters (quorum 2). The marker of a published message is on A as placed (keep()'s
    swap did not reach it) and on B as published; C never had it; B does not answer. The marker
    is on a quorum (A, B) and published (B says so): the message is queued. The answering
    masters (A, C) cannot rule that out, so the INVARIANT of _own_holder ("None only when the
    masters that answered rule out every value of this task being on a quorum") calls for the
    id or MastersUnavailable, never None: a caller publishing "if not queued" would then be
    refused, or wait for a marker it was told is not there; one concluding its work was lost
    would be wrong."""
    published = r24d.marked.apply_async((tag,), countdown=300, queue=f"r24d-nobody-{tag}")
    redlock = app_settings_and_redlock(r24d.app)[1]
    key = lock_key(redlock.key_prefix, f"r24d:{tag}")
    a, b, c = list(world.masters)
    with b.client() as client:
        value = client.get(key)
        ttl = client.pttl(key)
    assert value is not None and b'"published":true' in value, value
    with a.client() as client:
        client.set(key, value.replace(b'"published":true', b'"published":false'), px=ttl)
    with c.client() as client:
        client.delete(key)
    assert r24d.marked.queued_task_id(tag) == published.id  # all answer: A+B, published on B
    b.pause()
    try:
        try:
            answer = r24d.marked.queued_task_id(tag)
        except MastersUnavailable:
            answer = "unavailable"
        try:
            queued: Any = r24d.marked.is_queued(tag)
        except MastersUnavailable:
            queued = "unavailable"
    finally:
        b.resume()
    assert answer in (published.id, "unavailable"), (
        f"queued_task_id read {answer!r} (is_queued: {queued!r}) for a message published and "
        "marked on a quorum, one of whose masters did not answer"
    )
