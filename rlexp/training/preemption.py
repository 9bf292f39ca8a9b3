"""Preemption: what a training process does on SIGTERM (Kubernetes, Ray and Slurm send it before they kill
a pod or a job) and on SIGINT (Ctrl-C).

The first signal asks the loop to stop at the next point where its state is whole, and to checkpoint
there. Work that changes no training state (rollouts, scoring, eval generation) runs inside
``abandonable()``: a signal there abandons it at once, so the checkpoint describes the state before it
and the resumed run does that work again, bit for bit. Anything else (an optimizer update, a checkpoint
save, the tracker calls that record a step) is finished first. A watchdog ends the process at
``preempt_grace_s`` after the signal whatever it is doing, since the pod is killed then anyway: a
checkpoint not yet renamed into place is discarded at the next start and the previous one is used. A
second signal ends the process at once, the same way. The exit status is 128 + the signal's number
(143 for SIGTERM, 130 for SIGINT), as a shell reports a process the signal killed.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(BaseException):
    """Raised in the training loop after a SIGTERM/SIGINT. A BaseException, like KeyboardInterrupt, so that
    no ``except Exception`` on the way (a parser's, a tracker's) swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"preempted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Preemption:
    """Installs the SIGTERM/SIGINT handlers for the ``with`` block (in the main thread; elsewhere it only
    never fires) and puts the previous ones back after it."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        #: the first signal received, and when (``time.monotonic``).
        self.signum: int | None = None
        self.received_at: float | None = None
        self._abandonable = 0
        self._previous: dict[int, object] = {}
        self._done = threading.Event()

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            log.error("%s again: exiting now; the newest complete checkpoint stays as it is", name)
            os._exit(128 + signum)
        self.signum, self.received_at = signum, time.monotonic()
        log.warning("%s: stopping at the next safe point to checkpoint (within preempt_grace_s=%g s)", name, self.grace_s)
        threading.Thread(target=self._watchdog, args=(signum,), daemon=True, name="preempt-watchdog").start()
        if self._abandonable:
            raise Preempted(signum)

    def _watchdog(self, signum: int) -> None:
        if self._done.wait(self.grace_s):
            return
        log.error(
            "%s: not done within preempt_grace_s=%g s; exiting now (a checkpoint not yet complete is discarded at the "
            "next start, which resumes from the newest complete one)", signal.Signals(signum).name, self.grace_s,
        )
        logging.shutdown()
        os._exit(128 + signum)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        """Raise ``Preempted`` if a signal came: the caller's state is whole here."""
        if self.signum is not None:
            raise Preempted(self.signum)

    def seconds_since_signal(self) -> float:
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0

    @contextmanager
    def abandonable(self) -> Iterator[None]:
        """Work that changes no training state: a signal inside it (or before it) abandons it at once."""
        self.check()
        self._abandonable += 1
        try:
            yield
        finally:
            self._abandonable -= 1
