"""The base of every user-facing error: command lines print it as one line, no traceback.

Each module defines its own error types as subclasses of `JaxsimError`, with messages that name
the file (and line), tensor or option at fault. Subclassing ValueError keeps `except ValueError`
callers working.
"""
import contextlib
import functools
import signal
import site
import sysconfig
import traceback
from pathlib import Path
from typing import Iterator, Optional


class JaxsimError(ValueError):
    """Bad input or a request that cannot be done; the message says what and where."""


class ConfigError(JaxsimError):
    """A bad train or model configuration: unknown key, wrong type or out-of-range value."""


class UserCodeError(JaxsimError):
    """A user's objective, pooler or parameter initializer raised, or returned what its
    contract does not allow; the message names the function and the user's line."""


def shown_path(filename: str) -> str:
    """A file as messages name it: relative to the current folder when inside it."""
    path = Path(filename).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[Path, ...]:
    """Folders whose code is not the user's: jaxsim's own and Python's installed libraries."""
    paths = sysconfig.get_paths()
    dirs = [Path(__file__).parent] + [Path(paths[k]) for k in ('stdlib', 'platstdlib',
                                                               'purelib', 'platlib')]
    dirs += [Path(d) for d in site.getsitepackages() + [site.getusersitepackages()]]
    return tuple(d.resolve() for d in dirs)


def user_frame(error: BaseException, own: Optional[Path] = None
               ) -> Optional[traceback.FrameSummary]:
    """The deepest frame of `error`'s traceback in the user's code: `own` (a file, or a
    package's folder), or any file outside jaxsim and the installed libraries; None if none."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not Path(frame.filename).is_file():  # <string>, frozen modules
            continue
        path = Path(frame.filename).resolve()
        if (own is not None and path.is_relative_to(own.resolve())) or not any(
                path.is_relative_to(d) for d in _library_dirs()):
            return frame
    return None


def user_line(error: BaseException, own: Optional[Path] = None) -> str:
    """'FILE:LINE' of `user_frame` ('' when there is none)."""
    frame = user_frame(error, own)
    return f'{shown_path(frame.filename)}:{frame.lineno}' if frame is not None else ''


def is_jaxsims(fn) -> bool:
    """Whether `fn` (a function, class or functools.partial of one) is jaxsim's own code."""
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return (getattr(fn, '__module__', None) or '').startswith('jaxsim.')


@contextlib.contextmanager
def running_user_code(what: str, fn) -> Iterator[None]:
    """Runs a block that calls `fn`, a user's loss, pooler or initializer: what it raises is one
    `user_code_error` naming `what` and the user's line. A JaxsimError passes unchanged, and so
    does everything when `fn` is jaxsim's own (a bug keeps its traceback)."""
    try:
        yield
    except JaxsimError:
        raise
    except Exception as e:
        if is_jaxsims(fn):
            raise
        raise user_code_error(what, e) from e


def user_code_error(what: str, error: BaseException) -> UserCodeError:
    """The one-line error for `what` (e.g. "loss 'margin_loss'") having raised `error`."""
    where = user_line(error)
    message = ' '.join(str(error).split())
    return UserCodeError(f"{what} raised {type(error).__name__}"
                         f"{': ' + message[:300] if message else ''}"
                         f"{f' ({where})' if where else ''}")


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
