"""Process-level JAX settings shared by the command lines."""
from __future__ import annotations

import os
from pathlib import Path


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path:
    """Turns on JAX's persistent compilation cache.

    Encoding compiles one XLA program per length bucket and a flow fit compiles its whole network;
    on CPU that is seconds per program, paid again by every new process. With the cache on disk
    a second run of the same command reuses them. Directory: `directory`, else $JAXSIM_CACHE_DIR,
    else ~/.cache/jaxsim/xla.
    """
    import jax

    path = Path(directory or os.environ.get("JAXSIM_CACHE_DIR")
                or Path.home() / ".cache" / "jaxsim" / "xla")
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program that took noticeable time to compile (the default floor is 1 s).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    return path
