"""Training batches: tokenized once up front, a resumable per-process iterator, global arrays.

Text is tokenized ONCE (through the one tokenize/pad path, `jaxsim.data.tokenize`) into
fixed-length int32 arrays [examples, sentences per example, max_len], so the training loop
only slices arrays. The iterator is a pure function of (seed, epoch, step): its position is two
integers that a checkpoint saves for an exact resume. In a multi-process run every process
computes the same global permutation and takes only its own contiguous block of each global
batch (the block its devices own in the mesh); `to_global` assembles the blocks into one
global array.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxsim.data.readers import DataError
from jaxsim.data.tokenize import pad_batch, token_ids

log = logging.getLogger(__name__)

FIELDS = ('input_ids', 'attention_mask', 'token_type_ids')


def tokenize_examples(tokenizer, rows: Sequence[Sequence[str]] | Sequence[str], max_len: int,
                      source: str = '<data>') -> dict[str, np.ndarray]:
    """Tokenizes examples of one or more sentences to a fixed length (longer ones truncated).

    Args:
      tokenizer: a `transformers` tokenizer.
      rows: sentences, or tuples of sentences (all of one length).
      max_len: tokens per sentence including special tokens; shorter ones are padded.
      source: named in errors.

    Returns:
      {'input_ids', 'attention_mask', 'token_type_ids'}: int32 [N, views, max_len], views being
      the sentences per example (1 for a plain corpus).

    Raises:
      DataError: no examples, examples of different lengths, or an empty sentence.
    """
    rows = [(r,) if isinstance(r, str) else tuple(r) for r in rows]
    if not rows:
        raise DataError(f'{source}: no examples')
    views = len(rows[0])
    for i, r in enumerate(rows):
        if len(r) != views:
            raise DataError(f'{source}: example {i} has {len(r)} sentences, example 0 has {views}')
        for s in r:
            if not isinstance(s, str) or not s.strip():
                raise DataError(f'{source}: example {i} has an empty sentence')
    flat = [s for r in rows for s in r]
    ids = token_ids(tokenizer, flat, max_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = pad_batch(ids, pad_id, max_len)
    truncated = sum(len(x) >= max_len for x in ids)
    if truncated:
        log.info('%s: %d of %d sentences fill or exceed max_len=%d (truncated)', source,
                 truncated, len(flat), max_len)
    return {k: np.asarray(getattr(batch, k), np.int32).reshape(len(rows), views, max_len)
            for k in FIELDS}


def digest(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the arrays (names, shapes and bytes): identifies the tokenized data."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(f'{k}{a.shape}{a.dtype}'.encode())
        h.update(a.tobytes())
    return 'sha256:' + h.hexdigest()


@dataclasses.dataclass
class IteratorState:
    """Position of a `BatchIterator`: the next batch is batch `step` of epoch `epoch`."""

    epoch: int = 0
    step: int = 0


class BatchIterator:
    """Yields this process's block of each global batch, deterministically from the seed.

    Each epoch is a fresh permutation from `np.random.default_rng([seed, epoch])`. The examples
    left over after the full batches are dropped (`last_batch='drop'`), or form one smaller last
    batch (`'keep'`, as the HF Trainer does), rounded down to a multiple of `granularity` so it
    still splits evenly over the devices and accumulation steps.

    Args:
      arrays: numpy arrays with a leading example dimension N.
      global_batch: examples per global batch.
      seed: shuffling seed.
      process_index / process_count: this process's block of each global batch.
      shuffle: False keeps the data order.
      last_batch: 'drop' or 'keep'.
      granularity: the kept last batch is a multiple of this (batch shards x accumulation).
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], global_batch: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, shuffle: bool = True,
                 last_batch: str = 'drop', granularity: int = 1):
        self.arrays = dict(arrays)
        self.num_examples = len(next(iter(self.arrays.values())))
        if last_batch not in ('drop', 'keep'):
            raise ValueError(f"last_batch must be 'drop' or 'keep', got {last_batch!r}")
        granularity = int(np.lcm(granularity, process_count))
        if global_batch % granularity:
            raise ValueError(f'global batch {global_batch} is not divisible by {granularity} '
                             f'(the {process_count} processes x device/accumulation splits)')
        self.global_batch = global_batch
        self.process_index, self.process_count = process_index, process_count
        self.seed, self.shuffle = seed, shuffle
        self.full_batches = self.num_examples // global_batch
        rest = self.num_examples - self.full_batches * global_batch
        self.last_size = (rest // granularity) * granularity if last_batch == 'keep' else 0
        if self.steps_per_epoch == 0:
            raise DataError(f'{self.num_examples} examples cannot fill one global batch of '
                            f'{global_batch}')
        self.state = IteratorState()
        self._perm_epoch, self._perm = None, None

    @property
    def steps_per_epoch(self) -> int:
        return self.full_batches + (1 if self.last_size else 0)

    @property
    def dropped_per_epoch(self) -> int:
        """Examples of each epoch that no batch holds."""
        return self.num_examples - self.full_batches * self.global_batch - self.last_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
                          if self.shuffle else np.arange(self.num_examples))
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
        step = self.state.step
        size = self.global_batch if step < self.full_batches else self.last_size
        local = size // self.process_count
        start = step * self.global_batch + self.process_index * local
        idx = self._permutation(self.state.epoch)[start:start + local]
        self.state = IteratorState(self.state.epoch, step + 1)
        return {k: v[idx] for k, v in self.arrays.items()}


def to_global(local: Mapping[str, np.ndarray], shardings: Mapping[str, Any]) -> dict[str, Any]:
    """Assembles every process's block into global jax Arrays sharded on the batch dimension.

    Every process passes an equal block, so the global batch is rows x process count.
    """
    return {k: jax.make_array_from_process_local_data(
        shardings[k], v, (v.shape[0] * jax.process_count(),) + v.shape[1:])
        for k, v in local.items()}
