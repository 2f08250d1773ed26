"""The command lines' process set-up: library noise off, compilation cache on.

Every command applies it first (`python -m jaxsim`, train.py, eval.py; benchmarks too), before
anything initializes a JAX backend or loads a model. What is silenced, and why:
  - transformers' "PyTorch was not found" line and its other import-time advice: jaxsim runs
    JAX models; transformers is used for tokenizers and configs only
    (TRANSFORMERS_NO_ADVISORY_WARNINGS, TRANSFORMERS_VERBOSITY).
  - libtpu / XLA C++ INFO and WARNING logs at backend start-up (TPU_MIN_LOG_LEVEL,
    TPU_STDERR_LOG_LEVEL, TF_CPP_MIN_LOG_LEVEL, GRPC_VERBOSITY). Errors still print.
  - what `jaxsim.runtime` filters for library callers too (orphaned orbax read callbacks).
Every environment variable is set with `setdefault`: a value the user exported wins. This
module owns that list (`QUIET_ENV`).
"""
from __future__ import annotations

import os

from jaxsim import runtime

QUIET_ENV = {
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TF_CPP_MIN_LOG_LEVEL": "1",
    "TPU_MIN_LOG_LEVEL": "2",
    "TPU_STDERR_LOG_LEVEL": "2",
    "GRPC_VERBOSITY": "ERROR",
}


def quiet_environment() -> None:
    """Sets `QUIET_ENV` where the user has not: before transformers loads or a backend starts."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


def setup(compilation_cache: bool = True) -> None:
    """The one process set-up of an entry point; call it before loading models.

    Args:
      compilation_cache: turn on the persistent XLA compilation cache.
    """
    quiet_environment()
    runtime.ignore_orphaned_loop_callbacks()
    if compilation_cache:
        runtime.enable_compilation_cache()
