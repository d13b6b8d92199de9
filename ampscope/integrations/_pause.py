"""The pauses an integration opens where its library says the loop stops stepping on
purpose (an evaluation, a checkpoint save) and ends when training steps again.

A library's hooks say where such work begins, rarely where it ends (the save of a
checkpoint runs after the evaluation's last hook): an integration opens a pause at the
first hook and ends every pause it opened at the end of the next training step (after its
collectives: under DDP the ranks that do not write a checkpoint wait there for the one that
does), or when training ends or raises. Nested: a checkpoint within an evaluation's pause
says ``checkpoint``, with the evaluation's age (the rank took no step since).
"""

from __future__ import annotations

from ampscope.reporter.pause import Pause, paused


class OpenPauses:
    """The pauses one integration's hooks opened and not yet ended. Costs a lock and a
    dict update per pause opened or ended; nothing on a hook with nothing to do."""

    def __init__(self) -> None:
        self.opened: list[Pause] = []

    def open(self, reason: str) -> None:
        """Open a pause for ``reason`` unless the newest one open says it already."""
        if not (self.opened and self.opened[-1].reason == reason):
            self.opened.append(paused(reason))

    def done(self, reason: str) -> None:
        """The work ``reason`` ended: when the newest pause says it and an older one is
        open, the older one's work comes next and its reason is said again. A pause with
        none below it stays open until the next step (its library may still do work it
        announced no hook for)."""
        if len(self.opened) > 1 and self.opened[-1].reason == reason:
            self.opened.pop().end()

    def end(self) -> None:
        """End every pause opened here (training steps again, or ended)."""
        while self.opened:
            self.opened.pop().end()
