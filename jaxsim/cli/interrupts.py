"""SIGINT / SIGTERM in the command lines: one line, exit 130 / 143, no traceback, no partial file.

`install()` turns both signals into an `Interrupted` exception (a KeyboardInterrupt, so the
`finally` blocks of the output writers remove their temporary files on the way out) and the
entry point reports it with `report()`. Two places where Python would lose it:

  - Start-up. Before `install()` runs (while JAX and transformers import) a Ctrl-C would be a
    KeyboardInterrupt traceback and SIGTERM would kill the process. Entry points call `block()`
    first, before any heavy import; the signal then waits in the kernel and is delivered by
    `install()`, which unblocks it.
  - Garbage-collection callbacks. JAX registers one (`_xla_gc_callback`); an exception raised
    inside it is printed as "Exception ignored in ..." and dropped, and the run went on. The
    handler does not raise there: it has the signal sent again 10 ms later, from another
    thread, and it is raised at an ordinary line then. An interrupt lost in another such place
    (a `__del__`) reaches the unraisable-exception hook, which does the same.

`Interrupted` itself is the library's (jaxsim.errors): training raises it with the step saved.
Nothing here imports JAX; of jaxsim only errors and runtime (no JAX either): entry points import
it first.
"""
from __future__ import annotations

import _thread
import gc
import os
import signal
import sys
import threading
import time
from typing import Optional

from jaxsim import runtime
from jaxsim.errors import SIGNALS, Interrupted


def block() -> None:
    """Holds SIGINT/SIGTERM back (start-up); `install()` delivers any that arrived meanwhile."""
    if threading.current_thread() is threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def running_module() -> Optional[str]:
    """The module of `python -m MODULE`, else None."""
    argv = list(getattr(sys, "orig_argv", ()))[1:]
    while len(argv) >= 2 and argv[0].startswith("-"):
        if argv[0] == "-m":
            return argv[1]
        argv = argv[2:] if argv[0] in ("-W", "-X") else argv[1:]  # options with a value
    return None


def _in_gc_callback(frame) -> bool:
    """Whether `frame` runs inside a garbage-collection callback (an exception raised there
    is printed as 'Exception ignored' and dropped)."""
    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks} - {None}
    while frame is not None and codes:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _send_soon(signum: int) -> None:
    # A bare thread (threading.Thread.start waits on its start, a wait the signal would
    # interrupt again): 10 ms later the main thread is past the callback.
    _thread.start_new_thread(lambda: (time.sleep(0.01), os.kill(os.getpid(), signum)), ())


def _raise(signum, frame):
    if _in_gc_callback(frame):
        _send_soon(signum)  # raised where it cannot be lost
        return
    raise Interrupted(signum)


def install() -> None:
    """Signals raise `Interrupted` in the main thread from now on; unblocks held signals."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        signal.signal(signum, _raise)
    unblock()


def unblock() -> None:
    """Delivers signals held back by `block()` to the handlers now installed (a command with
    its own handlers, e.g. training, calls this once they are in place)."""
    if threading.current_thread() is not threading.main_thread():
        return
    runtime.chain_unraisable_hook(_redeliver)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _redeliver(unraisable) -> bool:
    """An interrupt lost in a `__del__` is sent again from another thread: raise_signal() here
    would run the handler at once, inside this hook, and lose it the same way."""
    signum = getattr(unraisable.exc_value, "signum", None)
    if isinstance(unraisable.exc_value, BaseException) and signum in SIGNALS:
        _send_soon(signum)
        return True
    return False


def report(e: BaseException) -> int:
    """Prints the one line for an interrupt and returns the exit status (130 / 143)."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted by {signal.Signals(signum).name}; no output file written", file=sys.stderr)
    return 128 + signum
