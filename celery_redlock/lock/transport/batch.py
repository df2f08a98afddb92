"""A pipelined batch's replies on one master's link: what :meth:`.round.Round.call_many` reads,
and the EVAL forms it sends again for the commands a master answered NOSCRIPT."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .commands import LATE, Command, Outcome, eval_form, is_noscript
from .link import IO_ERRORS

if TYPE_CHECKING:
    from .round import Round


def await_batch(
    rnd: Round, i: int, batch: Sequence[Command], deadline: float, read_first: bool
) -> list[Outcome]:
    """Master i's replies to ``batch``, in order, by ``deadline`` (see :meth:`Round.call_many`).

    A command answered NOSCRIPT (it ran nothing) is sent again as EVAL once the batch's
    replies are read, on the same link by the same deadline; its reply stands in for the
    NOSCRIPT. It runs after the batch's later commands, which a batch only ever holds for
    other keys (the heartbeat's extensions, a marker's two releases, an operator's reads).
    """
    outcomes: list[Outcome] = []
    for j in range(len(batch)):
        # After the first reply the rest have usually arrived with it: read before waiting.
        outcome = rnd._await(i, None, deadline, read_first=read_first or j > 0)
        outcomes.append(outcome)
        rest = len(batch) - j - 1
        if rest and outcome is LATE:
            link = rnd.links[i]
            assert link is not None
            link.owed += rest  # every later reply is behind the late one
            outcomes += [LATE] * rest
            break
        if rest and rnd.links[i] is None:  # the link was dropped: nothing more will come
            outcomes += [outcome] * rest
            break
    return resend_batch(rnd, i, batch, outcomes, deadline) if rnd._noscript else outcomes


def resend_batch(
    rnd: Round, i: int, batch: Sequence[Command], outcomes: list[Outcome], deadline: float
) -> list[Outcome]:
    """``outcomes`` with each NOSCRIPT replaced by the reply to the command's EVAL form, sent
    again to master i in one write (see await_batch)."""
    rnd._noscript = False
    forms = {j: eval_form(batch[j]) for j, outcome in enumerate(outcomes) if is_noscript(outcome)}
    resent = {j: form for j, form in forms.items() if form is not None}
    link = rnd.links[i]
    if not resent or link is None or link.late:
        return outcomes
    try:
        link.send(b"".join(resent.values()), deadline)
    except IO_ERRORS as exc:
        failed = rnd._drop(i, exc)
        return [failed if j in resent else outcome for j, outcome in enumerate(outcomes)]
    replies = await_batch(rnd, i, list(resent.values()), deadline, read_first=False)
    for j, reply in zip(resent, replies, strict=True):
        outcomes[j] = reply
    return outcomes
