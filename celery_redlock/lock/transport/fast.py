"""The fast transport (the default): rounds over the masters' own non-blocking links, with the
links of a clean round parked whole for the next (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence

from ..._fork import pid
from .linkset import LinkSet
from .master import Master
from .round import Round


class FastTransport:
    """Rounds over ``masters``; every round of one Redlock shares the parked link sets."""

    def __init__(self, masters: Sequence[Master]) -> None:
        self.masters = masters
        # Whole sets of idle links, one per master, that rounds leave and take (see LinkSet).
        self._sets: list[LinkSet] = []

    def round(self) -> Round:
        return Round(self.masters, self._sets)

    def close(self) -> None:
        """Close the parked sets' links (the masters' own idle links are closed by their
        owner, the Redlock, which shares the masters with its waiters' links)."""
        sets = self._sets
        while sets:
            try:
                linkset = sets.pop()
            except IndexError:
                break  # another thread's round took the last one
            if linkset.pid == pid():  # a parent's sets are the parent's to close
                for link in linkset.links:
                    link.close()

    def after_fork_in_child(self) -> None:
        # The parent's parked links are the parent's: dropped unused, as Master drops its idle
        # stacks, which closes only the child's copies of their sockets. Emptied in place: a
        # round under way in another thread at the fork may still hold the list.
        self._sets.clear()
