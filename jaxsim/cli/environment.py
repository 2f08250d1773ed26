"""The command lines' process set-up: library noise off, compilation cache on.

Every command applies it first (`python -m jaxsim`, train.py, eval.py, benchmarks/remat_memory.py),
before anything initializes a JAX backend or loads a model. `QUIET_ENV` silences transformers'
import-time advice ("PyTorch was not found": jaxsim uses transformers for tokenizers and configs
only) and libtpu / XLA's C++ INFO and WARNING logs at backend start-up (errors still print); a
value the user exported wins. With libtpu installed (the test extra installs it for the plan
command) but no TPU attached, libtpu prints five lines of errors before JAX falls back to the
CPU: the commands ask for the CPU there (`skips_absent_tpu`), so an error stays one line.
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import pkgutil

import jax

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
    """Sets `QUIET_ENV` where the user has not: before transformers loads or a backend starts;
    and JAX_PLATFORMS=cpu where `skips_absent_tpu`."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if skips_absent_tpu():
        os.environ['JAX_PLATFORMS'] = 'cpu'  # this process's children too
        jax.config.update('jax_platforms', 'cpu')  # JAX read the variable at its import


def _libtpu_installed() -> bool:
    return (importlib.util.find_spec('libtpu') is not None
            or bool(os.environ.get('TPU_LIBRARY_PATH')))


def _backend_plugins() -> bool:
    """Whether a JAX backend plugin (a GPU's) is installed: an entry point, or a module of the
    `jax_plugins` namespace package (JAX looks in both)."""
    if importlib.metadata.entry_points(group='jax_plugins'):
        return True
    spec = importlib.util.find_spec('jax_plugins')
    return spec is not None and any(pkgutil.iter_modules(spec.submodule_search_locations or []))


def _tpu_attached() -> bool:
    """A TPU chip on the PCI bus (JAX's own check) or a TPU device node; True where unsure."""
    try:
        from jax._src.hardware_utils import num_available_tpu_chips_and_device_id
        chips = num_available_tpu_chips_and_device_id()[0]
    except Exception:  # the check moved or failed: leave JAX to decide
        return True
    return chips > 0 or bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def skips_absent_tpu() -> bool:
    """Whether the commands run JAX on the CPU without trying the TPU backend: libtpu is
    installed (else JAX tries no TPU and nothing prints), no other backend plugin is
    installed (JAX then picks among its backends itself), no TPU is attached, and neither
    JAX_PLATFORMS nor JAX_FORCE_TPU_INIT is set (the user's choice wins)."""
    if os.environ.get('JAX_PLATFORMS') or 'JAX_FORCE_TPU_INIT' in os.environ:
        return False
    return _libtpu_installed() and not _backend_plugins() and not _tpu_attached()


def setup(compilation_cache: bool = True) -> None:
    """The one process set-up of an entry point; call it before loading models.

    Args:
      compilation_cache: turn on the persistent XLA compilation cache.
    """
    quiet_environment()
    runtime.ignore_orphaned_loop_callbacks()
    if compilation_cache:
        runtime.enable_compilation_cache()
