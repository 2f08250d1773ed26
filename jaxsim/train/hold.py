"""The workdir's lock for the processes of one training run."""
from __future__ import annotations

import contextlib
from typing import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxsim.io import store


@contextlib.contextmanager
def hold_workdir(workdir: store.Path, main: bool, say) -> Iterator[None]:
    """Holds the workdir's lock (process 0) while the run writes; every process learns whether
    it was had, so a refused run stops on all processes at once, before anything is written."""
    lock, refusal = None, None
    if main:
        try:
            lock = store.WorkdirLock(workdir, say=say).acquire()
        except store.WorkdirLockedError as e:
            refusal = e
    if jax.process_count() > 1:
        held = bool(multihost_utils.broadcast_one_to_all(np.int32(refusal is None)))
        if not held and refusal is None:
            refusal = store.WorkdirLockedError(f'--workdir {workdir} is in use by another run')
    if refusal is not None:
        raise refusal
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
