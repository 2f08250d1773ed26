"""A signal sent at a named moment of a command, for the tests of SIGINT / SIGTERM handling.

The moment is hooked inside the child process, which prints `PHASE <name>` on stderr and sends
the signal to itself right there: the signal lands where the test says, however fast or loaded
the machine is, and the parent checks the PHASE line. tests/train/resume_test.py hooks its
training moments with `fire` / `reached`; the command-line tests run a whole command under
`main`:

    python -c 'from tests.signal_phases import main; main()' PHASE SIGNAME -m MODULE ARGS...
    python -c 'from tests.signal_phases import main; main()' PHASE SIGNAME SCRIPT ARGS...

(run as `python -m MODULE ARGS...` / `python SCRIPT ARGS...` would run, start-up included).

Phases:
  start-up     right after the command holds SIGINT / SIGTERM back (`jaxsim.interrupts.block`,
               eval.py's first lines), before JAX imports: the signal waits in the kernel until
               the command installs its handlers.
  gc callback  inside JAX's garbage-collection callback, once the handlers are installed: an
               exception raised there would be printed as "Exception ignored" and lost.
  encoding     once `jaxsim.encode` has stored its first batch of vectors (the model loaded,
               the command under way).
  logged step  once training has written its first metrics row (the workdir held, the run
               under way); with SIGSTOP the run stays there, holding its workdir, until the
               test sends SIGCONT.

Nothing here imports JAX: the start-up phase comes before it.
"""
from __future__ import annotations

import gc
import os
import runpy
import signal
import sys

PHASES = ('start-up', 'gc callback', 'encoding', 'logged step')


def reached(phase: str) -> None:
    """Prints `PHASE <phase>` on stderr, on its own line (after a progress bar's too)."""
    print(f'\nPHASE {phase}', file=sys.stderr, flush=True)


def fire(phase: str, signum: int) -> None:
    """`reached(phase)`, then `signum` to this process (handled where Python next checks)."""
    reached(phase)
    os.kill(os.getpid(), signum)


def _once(phase: str, signum: int):
    fired = []

    def maybe_fire():
        if not fired:
            fired.append(phase)
            fire(phase, signum)
    return maybe_fire


def _hook_gc_callbacks(maybe_fire) -> None:
    """Wraps JAX's garbage-collection callbacks so that the next collection fires inside one."""
    wrapped = 0
    for i, callback in enumerate(gc.callbacks):
        if not getattr(callback, '__module__', '').startswith(('jax', 'jaxlib')):
            continue

        def hooked(gc_phase, info, _callback=callback):
            maybe_fire()
            return _callback(gc_phase, info)
        gc.callbacks[i] = hooked
        wrapped += 1
    if not wrapped:
        raise RuntimeError(f'no JAX garbage-collection callback among {gc.callbacks}')


def _hook_encoding(maybe_fire) -> None:
    encode_module = sys.modules['jaxsim.encode']  # (the package's `encode` is the function)
    store = encode_module._store

    def hooked(*args, **kwargs):
        store(*args, **kwargs)
        maybe_fire()
    encode_module._store = hooked


def _hook_logged_step(maybe_fire) -> None:
    from jaxsim.train.records import MetricsLog
    write = MetricsLog.write

    def hooked(self, *args, **kwargs):
        write(self, *args, **kwargs)
        maybe_fire()
    MetricsLog.write = hooked


def install(phase: str, signum: int) -> None:
    """Hooks `phase` (one of PHASES) in this process, before the command runs."""
    if phase not in PHASES:
        raise ValueError(f'unknown phase {phase!r}; one of {PHASES}')
    maybe_fire = _once(phase, signum)
    real_mask = signal.pthread_sigmask
    armed = []

    def mask(how, signals):
        previous = real_mask(how, signals)
        if how == signal.SIG_BLOCK and phase == 'start-up':
            maybe_fire()  # held back: delivered when the command installs its handlers
        elif how == signal.SIG_UNBLOCK and not armed:  # the handlers are in place
            armed.append(True)
            if phase == 'gc callback':
                _hook_gc_callbacks(maybe_fire)
            elif phase == 'encoding':
                _hook_encoding(maybe_fire)
            elif phase == 'logged step':
                _hook_logged_step(maybe_fire)
        return previous
    signal.pthread_sigmask = mask


def main(argv=None) -> None:
    """PHASE SIGNAME (-m MODULE | SCRIPT) ARGS...: runs the command as python would."""
    phase, signame, *command = sys.argv[1:] if argv is None else argv
    install(phase, getattr(signal, signame))
    if command[0] == '-m':
        module, args = command[1], command[2:]
        # As `python -m MODULE`: argv[0] is '-m' while the package imports (jaxsim/__init__.py
        # holds the signals back when it sees that).
        sys.argv, sys.orig_argv = ['-m', *args], [sys.executable, '-m', module, *args]
        runpy.run_module(module, run_name='__main__', alter_sys=True)
    else:
        script, args = command[0], command[1:]
        sys.argv, sys.orig_argv = [script, *args], [sys.executable, script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name='__main__')
