"""Graceful stop on SIGINT / SIGTERM: finish the step, save, say how to resume.

Inside `deferred_signals()` a signal only sets a flag; the train loop checks it after each step,
completes any checkpoint in flight, saves the current state and raises
`jaxsim.errors.Interrupted` with the step saved. A second signal while that happens is
ignored (the save is what makes the resume possible).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional

from jaxsim.errors import SIGNALS


class StopRequest:
    """Set by the first SIGINT/SIGTERM."""

    def __init__(self):
        self.signum: Optional[int] = None

    def __bool__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum


@contextlib.contextmanager
def deferred_signals() -> Iterator[StopRequest]:
    """Turns SIGINT/SIGTERM into a StopRequest flag for the duration (main thread only)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._handle) for s in SIGNALS}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
