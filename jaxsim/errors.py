"""The base of every user-facing error: command lines print it as one line, no traceback.

Each module defines its own error types as subclasses of `JaxsimError`, with messages that name
the file (and line), tensor or option at fault. Subclassing ValueError keeps `except ValueError`
callers working.
"""
import signal
from typing import Optional


class JaxsimError(ValueError):
    """Bad input or a request that cannot be done; the message says what and where."""


class ConfigError(JaxsimError):
    """A bad train or model configuration: unknown key, wrong type or out-of-range value."""


# Command lines print these as `error: <message>` and exit with USER_ERROR_EXIT; anything else
# is a bug and keeps its traceback.
USER_ERRORS = (JaxsimError, ValueError, TypeError, OSError)
USER_ERROR_EXIT = 1

# The stop requests a run honours: commands report them in one line (jaxsim.cli.interrupts),
# training saves its state first (jaxsim.train.signals).
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A command stopped by SIGINT or SIGTERM; `exit_code` is 128 + signum (130 / 143).

    Not an `Exception`: a loader's `except Exception` (which turns library failures into one
    error line) must let it through. Training sets `step`, the step its saved state is at
    (None when nothing was saved).
    """

    def __init__(self, signum: int, step: Optional[int] = None):
        self.signum, self.step = signum, step
        self.exit_code = 128 + signum
        saved = f": state saved at step {step}" if step is not None else ""
        super().__init__(signal.Signals(signum).name + saved)
