"""Process-wide helpers the library calls where noise or cost starts: log filters, the
persistent compilation cache, and a command's exit where a native teardown could hang it.

Library code calls the two narrow helpers (`quiet_absl_messages`, `ignore_orphaned_loop_callbacks`)
where the noise starts, so `jaxsim.load_pretrained` is quiet from a notebook too; the command
lines' process set-up (environment variables, then these) is `jaxsim.cli.environment.setup`.
Nothing here imports jaxsim.

What is silenced here, and why:
  - orbax's "Given directory is read only" warning, logged every time a checkpoint folder is
    opened for reading (which is what loading a train workdir does).
  - "RuntimeError: Event loop is closed" tracebacks after a failed checkpoint read: orbax runs
    the read on a private asyncio loop and closes it as soon as the first tensorstore read
    fails; the reads still in flight then complete into the closed loop and tensorstore reports
    each one through `sys.unraisablehook` (about ten lines per array). Likewise the read
    coroutines still pending: closing them makes orbax raise the read error once more, with
    the whole TensorStore spec, and asyncio's log of a task whose orbax error nobody retrieved.
    The failure itself is raised normally; only these orphaned completions are dropped.
    What is still pending at interpreter teardown is out of these hooks' reach (teardown may
    have removed them), so a command whose checkpoint read failed leaves without teardown
    (`leave_hard_at_exit`, called by jaxsim.formats.checkpoint).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Iterator, NoReturn


@contextlib.contextmanager
def quiet_absl_messages(*fragments: str) -> Iterator[None]:
    """Drops absl log records containing any of `fragments` while the block runs."""

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            return not any(f in message for f in fragments)

    logger = logging.getLogger("absl")
    drop = _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _is_orphaned_loop_callback(unraisable) -> bool:
    """A completion delivered to an asyncio loop that was already closed (see module doc)."""
    exc = unraisable.exc_value
    if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
        return False
    # asyncio raises it from BaseEventLoop._check_closed inside call_soon_threadsafe.
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return any(f.name == "call_soon_threadsafe" for f in frames)


def _is_orphaned_read(unraisable) -> bool:
    """A read of a damaged checkpoint still pending when the restore failed: closing its
    coroutine (GeneratorExit) makes orbax raise the read error again, to no one. The
    coroutine is orbax's own, or asyncio's wrapper of it (`ensure_future` of an awaitable:
    seen once in a loaded suite run, 200 lines of traceback after the one error line)."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is None:
        return False
    wrapper = code.co_name == "_wrap_awaitable" and "asyncio" in code.co_filename
    return (("orbax" in code.co_filename or wrapper)
            and isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit))


class _DropOrphanedTaskErrors(logging.Filter):
    """asyncio's "... exception was never retrieved" for a task whose error came from orbax:
    the failed read's siblings, garbage-collected after the failure was raised and reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in record.getMessage() or not record.exc_info:
            return True
        frames = traceback.extract_tb(record.exc_info[2])
        return not any("orbax" in f.filename for f in frames)


def ignore_orphaned_loop_callbacks() -> None:
    """Installs (once) an unraisable-exception hook dropping orphaned-callback reports only.

    Any other unraisable exception goes to the hook that was installed before.
    """
    if getattr(sys.unraisablehook, "_jaxsim_filter", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (_is_orphaned_loop_callback(unraisable) or _is_orphaned_read(unraisable)):
            previous(unraisable)

    hook._jaxsim_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropOrphanedTaskErrors) for f in log.filters):
        log.addFilter(_DropOrphanedTaskErrors())


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path:
    """Turns on JAX's persistent compilation cache.

    Encoding compiles one XLA program per batch shape and a flow fit compiles its whole
    network; on CPU that is seconds per program, paid again by every new process. With the
    cache on disk a second run of the same command reuses them. Directory: `directory`, else
    $JAXSIM_CACHE_DIR, else ~/.cache/jaxsim/xla.
    """
    import jax

    path = Path(directory or os.environ.get("JAXSIM_CACHE_DIR")
                or Path.home() / ".cache" / "jaxsim" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program that took noticeable time to compile (the default floor is 1 s).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path


# Why this process leaves without its exit handlers, if it must: native teardowns that can hang
# the exit (libtpu's compiler once loaded; JAX's coordination service whose peers never came).
_HARD_EXIT_REASONS: list[str] = []


def leave_hard_at_exit(reason: str) -> None:
    """Marks this process's exit as one that must skip the exit handlers (`exit_process`)."""
    _HARD_EXIT_REASONS.append(reason)


def exit_process(code: int) -> NoReturn:
    """A command line's exit: `sys.exit(code)`, or, when `leave_hard_at_exit` was called,
    `os._exit(code)` after flushing stdout and stderr (what the command had to say is out)."""
    if _HARD_EXIT_REASONS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
