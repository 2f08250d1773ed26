"""Process-wide helpers the library calls where noise or cost starts: log filters, the
persistent compilation cache, and a command's exit where a native teardown could hang it.

Library code calls the narrow helpers where the noise starts, so `jaxsim.load_pretrained` is
quiet from a notebook too; the command lines' process set-up is `jaxsim.cli.environment.setup`.
Nothing here imports jaxsim.

After a failed checkpoint read, orbax closes its private asyncio loop while reads are still in
flight: their completions, the pending read coroutines and their tasks' unretrieved errors
would each print a traceback after the one error line (`ignore_orphaned_loop_callbacks` drops
them). What is still pending at interpreter teardown is out of the hooks' reach, so such a
command leaves without teardown (`leave_hard_at_exit`, called by jaxsim.formats.checkpoint).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn


@contextlib.contextmanager
def quiet_absl_messages(*fragments: str) -> Iterator[None]:
    """Drops absl log records containing any of `fragments` while the block runs."""

    def keep(record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in fragments)

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def chain_unraisable_hook(handle: Callable[[Any], bool]) -> None:
    """Puts `handle` (once) before the unraisable-exception hook: what it does not handle
    (returns False for) goes on to the hook installed before."""
    if handle in getattr(sys.unraisablehook, "_jaxsim_handlers", ()):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not handle(unraisable):
            previous(unraisable)

    hook._jaxsim_handlers = (handle, *getattr(previous, "_jaxsim_handlers", ()))
    sys.unraisablehook = hook


def _is_orphaned(unraisable) -> bool:
    """A completion delivered to an asyncio loop that was already closed (see module doc), or a
    read of a damaged checkpoint still pending when the restore failed: closing its coroutine
    (GeneratorExit) makes orbax raise the read error again, to no one. The coroutine is
    orbax's own, or asyncio's wrapper of it (`ensure_future` of an awaitable: seen once in a
    loaded suite run, 200 lines of traceback after the one error line)."""
    exc, frames = unraisable.exc_value, traceback.extract_tb(unraisable.exc_traceback)
    # asyncio raises the first from BaseEventLoop._check_closed inside call_soon_threadsafe.
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and any(
            f.name == "call_soon_threadsafe" for f in frames):
        return True
    code = getattr(unraisable.object, "cr_code", None)
    if code is None:
        return False
    wrapper = code.co_name == "_wrap_awaitable" and "asyncio" in code.co_filename
    return (("orbax" in code.co_filename or wrapper)
            and isinstance(getattr(exc, "__cause__", None), GeneratorExit))


def _keep_task_error(record: logging.LogRecord) -> bool:
    """False for asyncio's "... exception was never retrieved" of a task whose error came from
    orbax: the failed read's siblings, garbage-collected after the failure was reported."""
    if "exception was never retrieved" not in record.getMessage() or not record.exc_info:
        return True
    return not any("orbax" in f.filename for f in traceback.extract_tb(record.exc_info[2]))


def ignore_orphaned_loop_callbacks() -> None:
    """Drops (from now on) the orphaned-callback reports only: any other unraisable exception
    goes to the hook that was installed before, any other asyncio record is logged."""
    chain_unraisable_hook(_is_orphaned)
    log = logging.getLogger("asyncio")
    if _keep_task_error not in log.filters:
        log.addFilter(_keep_task_error)


def enable_compilation_cache() -> Path:
    """Turns on JAX's persistent compilation cache.

    Encoding compiles one XLA program per batch shape and a flow fit compiles its whole
    network; on CPU that is seconds per program, paid again by every new process. With the
    cache on disk a second run of the same command reuses them. Directory: $JAXSIM_CACHE_DIR,
    else ~/.cache/jaxsim/xla.
    """
    import jax

    path = Path(os.environ.get("JAXSIM_CACHE_DIR") or Path.home() / ".cache" / "jaxsim" / "xla")
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
