"""Process set-up shared by every entry point: environment, log noise, compilation cache.

Entry points (`python -m jaxsim`, train.py, eval.py, benchmarks) call `setup()` first, before
anything initializes a JAX backend or imports transformers. Library code calls the two narrow
helpers below where the noise starts (`quiet_absl_messages`, `ignore_orphaned_loop_callbacks`)
so `jaxsim.load_pretrained` is quiet from a notebook too. Nothing here imports jaxsim.

What is silenced, and why:
  - transformers' "PyTorch was not found" line: jaxsim runs JAX models; transformers is used for
    tokenizers and configs only (TRANSFORMERS_NO_ADVISORY_WARNINGS).
  - libtpu / XLA C++ INFO and WARNING logs at backend start-up (TPU_MIN_LOG_LEVEL,
    TPU_STDERR_LOG_LEVEL, TF_CPP_MIN_LOG_LEVEL, GRPC_VERBOSITY). Errors still print.
  - orbax's "Given directory is read only" warning, logged every time a checkpoint folder is
    opened for reading (which is what loading a train workdir does).
  - "RuntimeError: Event loop is closed" tracebacks after a failed checkpoint read: orbax runs
    the read on a private asyncio loop and closes it as soon as the first tensorstore read
    fails; the reads still in flight then complete into the closed loop and tensorstore reports
    each one through `sys.unraisablehook` (about ten lines per array). Likewise the read
    coroutines still pending: closing them makes orbax raise the read error once more, with
    the whole TensorStore spec. The failure itself is raised normally; only these orphaned
    completions are dropped.
Every environment variable is set with `setdefault`: a value the user exported wins.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Iterator

_QUIET_ENV = {
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "1",
    "TPU_MIN_LOG_LEVEL": "2",
    "TPU_STDERR_LOG_LEVEL": "2",
    "GRPC_VERBOSITY": "ERROR",
}


def setup(compilation_cache: bool = True) -> None:
    """The one process set-up of an entry point; call it before loading models.

    Args:
      compilation_cache: turn on the persistent XLA compilation cache.
    """
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    ignore_orphaned_loop_callbacks()
    if compilation_cache:
        enable_compilation_cache()


def release_host_memory() -> bool:
    """Hands the C heap's free pages back to the system (glibc `malloc_trim`); False elsewhere.

    Compiling a train step leaves ~200 MB of freed compiler memory in glibc's heaps (minilm,
    XLA:CPU), which it keeps as resident pages; released before the first step runs, the step's
    working memory lands below, not on top of it (peak RSS lower by about that much).
    """
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


# glibc's malloc backs the blocks it maps with transparent huge pages (glibc >= 2.35, read
# when a process starts; where THP is off or the glibc older, nothing changes).
HUGE_PAGE_HEAP_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def restart_with_huge_page_heap() -> None:
    """Restarts this process (same interpreter, same command line) once with
    `HUGE_PAGE_HEAP_ENV`; does nothing where GLIBC_TUNABLES is already set or the C library is
    not glibc. For XLA:CPU programs run many times; call it first in a script's main.

    XLA:CPU allocates a program's temporaries on every run (the minilm train step: about 1 GB)
    and glibc serves such a block with a fresh mmap, unmapped when freed, so every step
    page-faults its working memory in again: about 232,000-260,000 faults and 0.4 s of kernel
    time a step on 2 cores (12-18% of its CPU time). In 2 MB pages that is ~1,400 faults.
    Measured (float32 unsup step, back-to-back processes, under load): CPU per step 3.56 ->
    2.93 s, peak RSS 1705 -> 1697 MB. (Keeping freed blocks instead, by one arena, no mmap and
    no trim, cut the faults as well but let the heap grow by a second 1 GB block.)
    """
    if "GLIBC_TUNABLES" in os.environ or not sys.executable or not sys.orig_argv:
        return
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    os.environ.update(HUGE_PAGE_HEAP_ENV)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def compile_ahead(step, *args):
    """Compiles a jitted `step` for `args` (its next call with such arguments reuses the
    executable), then hands the compiler's freed heap back (`release_host_memory`), so the
    step's working memory is not allocated on top of it. Returns the compiled executable (for
    its cost analysis); None for a plain function, which is left as it is."""
    if not hasattr(step, "lower"):
        return None
    compiled = step.lower(*args).compile()
    release_host_memory()
    return compiled


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
    coroutine (GeneratorExit) makes orbax raise the read error again, to no one."""
    code = getattr(unraisable.object, "cr_code", None)
    return (code is not None and "orbax" in code.co_filename
            and isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit))


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
