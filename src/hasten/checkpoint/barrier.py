"""``CopyBarrier``: what the next optimizer step waits for while an asynchronous save copies.

An asynchronous ``save_state`` returns before the parameters and the optimizer state are copied
to host memory: its writer thread copies them while the loop runs its next forward and backward.
Each such save adds an event here (``add``), which the writer thread sets once its copy is made.
The Accelerator makes one barrier and gives it to its ``Checkpointer`` and, at ``prepare``, to
every optimizer it prepares; the optimizer's step (and whatever else of hasten writes into the
weights in place: ``load_model``, LocalSGD's averaging, an optimizer's ``load_state_dict``)
waits on it before it changes anything. With nothing in flight, ``events`` is an empty list: a
step tests it and goes on (the list object never changes, so an optimizer keeps a reference to it).
"""

from __future__ import annotations

import threading


class Copying(threading.Event):
    """Set by the writer thread once an asynchronous save copied what it saves; ``target`` names
    the save, for a wait's error."""

    def __init__(self, target: str = "") -> None:
        super().__init__()
        self.target = target


class CopyBarrier:
    """The copies of asynchronous saves not made yet, oldest first (``events``)."""

    def __init__(self) -> None:
        self.events: list[threading.Event] = []

    def add(self, event: threading.Event) -> None:
        """An asynchronous save started: the next step waits until ``event`` is set."""
        self.events.append(event)

    def prune(self) -> None:
        """Forget the copies already made (the list object stays the same)."""
        self.events[:] = [e for e in self.events if not e.is_set()]

    def wait(self) -> None:
        """Until every asynchronous save in flight has copied what it saves; a ``TimeoutError``
        once one took longer than the run's timeout (``InitProcessGroupKwargs.timeout``, see
        ``hasten.settings.groups.group_timeout``: read only when something is in flight)."""
        if not self.events:
            return
        from hasten.distributed.state import timeout_error
        from hasten.settings.groups import group_timeout

        timeout = group_timeout()
        while self.events:
            copied = self.events[0]
            if not copied.wait(None if timeout is None else timeout.total_seconds()):
                target = getattr(copied, "target", "")
                what = f"the asynchronous save_state{f' of {target!r}' if target else ''}"
                assert timeout is not None  # an unbounded wait returns only once the copy is made
                raise timeout_error(f"{what} (its copy of the weights and optimizer state, waited for here)", timeout)
            self.events.pop(0)
