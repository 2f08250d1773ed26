"""Multi-process (multi-host) start-up: `jax.distributed.initialize` when asked for.

A run is multi-process when a coordinator address is given explicitly (flags) or through the
environment (JAXSIM_COORDINATOR, JAXSIM_NUM_PROCESSES, JAXSIM_PROCESS_ID), or when JAX's own
cluster auto-detection applies (SLURM, TPU pods, ...; pass `auto=True`). On one CPU machine,
several processes on loopback use CPU (gloo) collectives, which is how the tests run it.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

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
        # JAX detects the cluster (TPU pod slice, SLURM, Open MPI, ...) from its environment.
        jax.config.update('jax_cpu_collectives_implementation', 'gloo')
        try:
            jax.distributed.initialize()
        except (RuntimeError, ValueError) as e:
            raise DistributedError(f'--distributed auto: no cluster detected ({e}); start on a '
                                   f'TPU pod, under SLURM or Open MPI, or pass --coordinator, '
                                   f'--num_processes and --process_id') from None
        _initialized = True
    return jax.process_count() > 1


def add_launch_flags(parser) -> None:
    """The multi-process launch flags every command takes (train.py, eval.py, encode)."""
    parser.add_argument('--coordinator', default=None,
                        help='jax.distributed coordinator host:port (multi-process launch)')
    parser.add_argument('--num_processes', type=int, default=None)
    parser.add_argument('--process_id', type=int, default=None)
    parser.add_argument('--distributed', choices=('auto',), default=None,
                        help="'auto': jax.distributed.initialize() detects the cluster (TPU pod "
                             'slice, SLURM, Open MPI); start the same command on every host')


def initialize_from_flags(args) -> bool:
    """`initialize` with the flags of `add_launch_flags`; True when multi-process."""
    return initialize(args.coordinator, args.num_processes, args.process_id,
                      auto=args.distributed == 'auto')


def is_main_process() -> bool:
    """Process 0 writes logs, metrics and the summary (orbax coordinates its own writes)."""
    return jax.process_index() == 0


def max_over_processes(value: int) -> int:
    """The largest of every process's `value` (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def _digest_words(value: Any) -> np.ndarray:
    """8 uint32 words of sha256 over the canonical JSON of `value` (strings hash as such)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32)


def check_same_inputs(inputs: Mapping[str, Any]) -> None:
    """Refuses to start when the processes of a run do not see the same inputs.

    Every process passes the same names (e.g. {'config': ..., 'corpus': digest}); each value
    is hashed and the hashes are all-gathered. A collective: every process must call it.

    Raises:
      DistributedError: naming the first input and the processes whose value differs from
        process 0's.
    """
    if jax.process_count() == 1:
        return
    names = sorted(inputs)
    local = np.stack([_digest_words(inputs[n]) for n in names])  # [inputs, 8]
    everyone = np.asarray(multihost_utils.process_allgather(local))  # [processes, inputs, 8]
    for i, name in enumerate(names):
        differ = [p for p in range(everyone.shape[0])
                  if not np.array_equal(everyone[p, i], everyone[0, i])]
        if differ:
            which = ', '.join(map(str, differ))
            raise DistributedError(f'process {which} of {everyone.shape[0]} sees a different '
                                   f'{name} than process 0; every process must start the same '
                                   f'run on the same data')
