"""TensorBoard scalars: the one writer of event files (tensorboardX: no TensorFlow needed).

Training and flow fits write here; only process 0 writes, and only to local folders (event
files are appended to as the run goes, which object stores cannot do).

Steps never show twice: a writer opened with `purge_step=S` marks its file so that
TensorBoard drops the steps >= S that earlier writers left in the same folder (a resumed run
opens at its checkpoint's step + 1, a refit at 0). Each writer gets its own file, named to sort
in opening order (tensorboardX names files by the second: a second writer within the same
second would truncate the first's, and TensorBoard applies purges in file order).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.abc
import math
import sys
import time
from typing import Mapping, Optional

import jax

from jaxsim.storage import store


class _WithoutTorch(importlib.abc.MetaPathFinder):
    """Makes `import torch` fail while installed (nothing else is touched)."""

    def find_spec(self, name, path=None, target=None):
        if name == 'torch' or name.startswith('torch.'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
        return None


@functools.cache
def summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch unless torch is already loaded.

    tensorboardX imports torch whenever it is installed, only to accept torch tensors as values,
    which would cost a JAX process its memory (docs/performance.md, "Figures the code relies
    on"); scalars here are floats. Imported by the first writer, not at start-up.
    """
    if 'torch' in sys.modules or 'tensorboardX' in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    finder = _WithoutTorch()
    sys.meta_path.insert(0, finder)
    try:
        from tensorboardX import SummaryWriter
    finally:
        sys.meta_path.remove(finder)
    return SummaryWriter


class ScalarWriter(contextlib.AbstractContextManager):
    """Scalars by tag and step into the event files of `folder` (process 0, local only).

    Args:
      folder: the log folder (`tensorboard --logdir` it or a parent of it).
      purge_step: TensorBoard drops earlier writers' steps >= this one.
    """

    def __init__(self, folder: store.PathLike, purge_step: int = 0):
        self._writer = None
        if jax.process_index() == 0 and not store.is_remote(folder):
            self._writer = summary_writer_class()(str(folder), purge_step=int(purge_step),
                                                  filename_suffix=f'.{time.time_ns()}')

    @property
    def active(self) -> bool:
        """Whether this process writes (process 0, a local folder, not closed)."""
        return self._writer is not None

    def write(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        """One point per tag at `step`; None and non-finite values are left out."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(float(value)):
                self._writer.add_scalar(tag, float(value), int(step))
        self._writer.flush()  # a killed run keeps what it logged

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __exit__(self, *exc) -> None:
        self.close()


def optional_writer(folder: Optional[store.PathLike]) -> Optional[ScalarWriter]:
    """A ScalarWriter for `folder` (a fresh curve: purge_step 0), or None when none is given."""
    return None if folder is None or str(folder) == '' else ScalarWriter(folder)
