"""Multi-process (multi-host) start-up: `jax.distributed.initialize` when asked for.

A run is multi-process when a coordinator address is given explicitly (flags) or through the
environment (JAXSIM_COORDINATOR, JAXSIM_NUM_PROCESSES, JAXSIM_PROCESS_ID), or when JAX's own
cluster auto-detection applies (SLURM, TPU pods, ...; pass `auto=True`). On one CPU machine,
several processes on loopback use CPU (gloo) collectives, which is how the tests run it.
"""
from __future__ import annotations

import os

import jax

from jaxsim.errors import JaxsimError

_initialized = False


class DistributedError(JaxsimError):
    """Multi-process settings that cannot start a run (the message names the setting)."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"${name}={value!r} is not an integer") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None, auto: bool = False) -> bool:
    """Initializes jax.distributed once; returns True when running multi-process.

    Must be called before any JAX computation. Arguments default to the JAXSIM_* env vars.
    """
    global _initialized
    if _initialized:
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get('JAXSIM_COORDINATOR')
    if num_processes is None:
        num_processes = _env_int('JAXSIM_NUM_PROCESSES')
    if process_id is None:
        process_id = _env_int('JAXSIM_PROCESS_ID')
    if coordinator_address:
        if num_processes is None or process_id is None:
            raise DistributedError('a coordinator address needs num_processes and process_id '
                                   '(or JAXSIM_NUM_PROCESSES / JAXSIM_PROCESS_ID)')
        if not 0 <= process_id < num_processes:
            raise DistributedError(f'process_id {process_id} is not in [0, {num_processes})')
        # Cross-process collectives of CPU devices go through gloo (harmless on accelerators).
        # Set before the backend exists: querying the backend here would initialize it.
        jax.config.update('jax_cpu_collectives_implementation', 'gloo')
        jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids)
        _initialized = True
    elif auto:
        jax.distributed.initialize()
        _initialized = True
    return jax.process_count() > 1


def is_main_process() -> bool:
    """Process 0 writes logs, metrics and the summary (orbax coordinates its own writes)."""
    return jax.process_index() == 0
