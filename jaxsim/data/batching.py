"""Training batches: tokenized once up front, a resumable per-process iterator, global arrays.

Text is tokenized ONCE into fixed-length int32 numpy arrays (padded to the config's max_len),
so the training loop only slices arrays. The iterator is a pure function of (seed, epoch,
step): its position is two integers that a checkpoint can save and restore for an exact
resume. In a multi-process run every process computes the same global permutation and takes
only its own contiguous block of each global batch (the block its devices own in the mesh),
which `jax.make_array_from_process_local_data` then assembles into one global array.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxsim.data.readers import DataError

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Tokenization (off the hot path).
# ---------------------------------------------------------------------------------------------

def tokenize_fixed(tokenizer, sentences: Sequence[str], max_len: int,
                   source: str = '<data>') -> dict[str, np.ndarray]:
    """Tokenizes to a fixed padded length; longer sentences are truncated (and counted).

    Returns:
      {'input_ids', 'attention_mask', 'token_type_ids'}: int32 [N, max_len].
    """
    for i, s in enumerate(sentences):
        if not isinstance(s, str) or not s.strip():
            raise DataError(f'{source}: sentence {i} is empty')
    enc = tokenizer(list(sentences), max_length=max_len, truncation=True,
                    padding='max_length', return_overflowing_tokens=False)
    out = {k: np.asarray(enc[k], dtype=np.int32)
           for k in ('input_ids', 'attention_mask')}
    tt = enc.get('token_type_ids')
    out['token_type_ids'] = (np.asarray(tt, np.int32) if tt is not None
                             else np.zeros_like(out['input_ids']))
    full = int(np.sum(out['attention_mask'][:, -1] == 1))
    if full:
        log.info('%s: %d of %d sentences fill or exceed max_len=%d (truncated)', source, full,
                 len(sentences), max_len)
    return out


def tokenize_examples(tokenizer, rows: Sequence[Sequence[str]] | Sequence[str], max_len: int,
                      source: str = '<data>') -> dict[str, np.ndarray]:
    """Tokenizes examples of 1 (unsup) or 3 (sup) sentences.

    Returns:
      {'input_ids', 'attention_mask', 'token_type_ids'}: int32 [N, views, max_len] where views is
      1 for a plain corpus and 3 for (sent0, sent1, hard_neg). Unsupervised duplication into two
      views happens inside the jitted step (no host copy).
    """
    if rows and isinstance(rows[0], str):
        rows = [(r,) for r in rows]
    views = len(rows[0])
    flat = [s for r in rows for s in r]
    tok = tokenize_fixed(tokenizer, flat, max_len, source)
    return {k: v.reshape(len(rows), views, max_len) for k, v in tok.items()}


# ---------------------------------------------------------------------------------------------
# Deterministic, resumable, per-process iterator.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class IteratorState:
    """Position of a `BatchIterator`: next batch = batch `step` of epoch `epoch`."""

    epoch: int = 0
    step: int = 0


class BatchIterator:
    """Yields this process's block of each global batch, deterministically from the seed.

    Each epoch is a fresh permutation drawn from `np.random.default_rng([seed, epoch])`; the
    last incomplete global batch of an epoch is dropped (a fixed batch shape means one
    compilation and a constant number of negatives).

    Args:
      arrays: dict of numpy arrays with a leading example dimension N.
      global_batch: examples per global batch.
      seed: shuffling seed.
      process_index / process_count: this process's block of each global batch.
      shuffle: False keeps corpus order (for tests and evaluation).
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], global_batch: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, shuffle: bool = True):
        self.arrays = dict(arrays)
        self.num_examples = len(next(iter(self.arrays.values())))
        if global_batch % process_count:
            raise ValueError(f'global batch {global_batch} is not divisible by the '
                             f'{process_count} processes')
        if self.num_examples < global_batch:
            raise DataError(f'{self.num_examples} examples cannot fill one global batch of '
                            f'{global_batch}')
        self.global_batch = global_batch
        self.local_batch = global_batch // process_count
        self.seed, self.process_index, self.shuffle = seed, process_index, shuffle
        self.state = IteratorState()
        self._perm_epoch, self._perm = None, None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(
                    self.num_examples)
            else:
                self._perm = np.arange(self.num_examples)
            self._perm_epoch = epoch
        return self._perm

    def get_state(self) -> dict[str, int]:
        return dataclasses.asdict(self.state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.state = IteratorState(epoch=int(state['epoch']), step=int(state['step']))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.state.step >= self.steps_per_epoch:
            self.state = IteratorState(self.state.epoch + 1, 0)
        perm = self._permutation(self.state.epoch)
        start = self.state.step * self.global_batch + self.process_index * self.local_batch
        idx = perm[start:start + self.local_batch]
        self.state = IteratorState(self.state.epoch, self.state.step + 1)
        return {k: v[idx] for k, v in self.arrays.items()}


def to_global(local: Mapping[str, np.ndarray], shardings: Mapping[str, Any],
              global_batch: int) -> dict[str, Any]:
    """Assembles per-process blocks into global jax Arrays sharded on the batch dimension."""

    return {k: jax.make_array_from_process_local_data(
        shardings[k], v, (global_batch,) + v.shape[1:]) for k, v in local.items()}


