"""Training batches: fixed-length tokenization, the global batch order (docs/training.md).

Which example comes at each position of an epoch is a pure function of (seed, epoch, position)
(`EpochOrder`), whatever the batch size; each process feeds only its own rows of each global
batch. `BatchIterator` serves arrays in memory; `jaxsim.data.pipeline` streams from sources.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np

from jaxsim.data.readers import DataError
from jaxsim.data.tokenize import pad_batch, token_ids

log = logging.getLogger(__name__)

FIELDS = ('input_ids', 'attention_mask', 'token_type_ids')


def tokenize_examples(tokenizer, rows: Sequence[Sequence[str]] | Sequence[str], max_len: int,
                      source: str = '<data>', log_truncated: bool = True
                      ) -> dict[str, np.ndarray]:
    """Sentences, or tuples of sentences (all of one length), as int32 [N, views, max_len]
    arrays per field (docs/api.md), longer ones truncated; `source` is named in errors."""
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
    batch = pad_batch(ids, tokenizer.pad_token_id or 0, max_len)
    truncated = sum(len(x) >= max_len for x in ids)
    if truncated and log_truncated:
        log.info('%s: %d of %d sentences fill or exceed max_len=%d (truncated)', source,
                 truncated, len(flat), max_len)
    return {k: np.asarray(getattr(batch, k), np.int32).reshape(len(rows), views, max_len)
            for k in FIELDS}


@dataclasses.dataclass
class IteratorState:
    """Position of an iterator: the next batch starts at position `example` of epoch `epoch`'s
    order, after `step` batches of that epoch.

    `example`, not `step`, says where to go on: a batch index means other examples under
    another batch size (`--allow-change=batch_size`), an example position does not.
    """

    epoch: int = 0
    step: int = 0
    example: int = 0


def epoch_seed(seed: int, epoch: int) -> int:
    """The 32-bit shuffling seed of one epoch (distinct epochs and seeds never collide the way
    seed + epoch would)."""
    return int(np.random.SeedSequence([seed % 2**64, epoch]).generate_state(1, np.uint32)[0])


def process_rows(size: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
    """The rows of a global batch of `size` that one process feeds: its contiguous block."""
    local = size // process_count
    return np.arange(process_index * local, (process_index + 1) * local)


class EpochOrder:
    """Which examples each global batch holds: a pure function of (seed, epoch, position).

    Epoch e visits the examples in the order of a pseudo-random permutation computed one index
    at a time (`grain.experimental.index_shuffle`, seeded by `epoch_seed(seed, e)`): no
    permutation array is ever built, so the order costs the same memory for any corpus size,
    and every process, whatever the process or device count, agrees on every global batch.
    The examples left over after the full batches are dropped (`last_batch='drop'`), or form
    one smaller last batch (`'keep'`, as the HF Trainer does), rounded down to a multiple of
    `granularity` so it still splits evenly over the devices and accumulation steps.
    `process_count` processes split each batch (the batch must divide among them).
    """

    def __init__(self, num_examples: int, global_batch: int, seed: int = 0, shuffle: bool = True,
                 last_batch: str = 'drop', granularity: int = 1, process_count: int = 1):
        if last_batch not in ('drop', 'keep'):
            raise ValueError(f"last_batch must be 'drop' or 'keep', got {last_batch!r}")
        granularity = int(np.lcm(granularity, process_count))
        if global_batch % granularity:
            raise ValueError(f'global batch {global_batch} is not divisible by {granularity} '
                             f'(the {process_count} processes x device/accumulation splits)')
        if num_examples >= 2**32:
            raise DataError(f'{num_examples} examples: the shuffle addresses at most 2**32')
        self.num_examples, self.global_batch = num_examples, global_batch
        self.seed, self.shuffle = seed, shuffle
        self.keep_last, self.granularity = last_batch == 'keep', granularity
        self.full_batches = num_examples // global_batch
        self.last_size = self.size_at(self.full_batches * global_batch)
        if self.steps_per_epoch == 0:
            raise DataError(f'{num_examples} examples cannot fill one global batch of '
                            f'{global_batch}')

    @property
    def steps_per_epoch(self) -> int:
        return self.full_batches + (1 if self.last_size else 0)

    @property
    def dropped_per_epoch(self) -> int:
        """Examples of each epoch that no batch holds."""
        return self.num_examples - self.full_batches * self.global_batch - self.last_size

    def size_at(self, start: int) -> int:
        """Examples in the global batch that starts at position `start` of an epoch: a full
        batch, else what is left (rounded to the granularity) when the last batch is kept,
        else 0 (the epoch is over). `start` need not be a multiple of the batch: a run resumed
        with another batch size goes on from the position it stopped at."""
        left = max(self.num_examples - start, 0)
        if left >= self.global_batch:
            return self.global_batch
        return (left // self.granularity) * self.granularity if self.keep_last else 0

    def batches_from(self, start: int) -> int:
        """Global batches of an epoch from position `start` to its end."""
        full = max(self.num_examples - start, 0) // self.global_batch
        return full + (1 if self.size_at(start + full * self.global_batch) else 0)

    def examples(self, epoch: int, step: int, rows: np.ndarray) -> np.ndarray:
        """The example indices at `rows` of global batch `step` of `epoch`."""
        return self.examples_at(epoch, step * self.global_batch, rows)

    def examples_at(self, epoch: int, start: int, rows: np.ndarray) -> np.ndarray:
        """The example indices at `rows` of the global batch at position `start` of `epoch`."""
        positions = start + np.asarray(rows, np.int64)
        if not self.shuffle:
            return positions
        # grain is imported by the first shuffled order, not by every process that tokenizes a
        # batch (its cost: docs/performance.md).
        from grain.experimental import index_shuffle
        seed, last = epoch_seed(self.seed, epoch), self.num_examples - 1
        return np.array([index_shuffle(int(p), max_index=last, seed=seed, rounds=4)
                         for p in positions], np.int64)


class OrderedIterator:
    """This process's rows of each global batch, in `EpochOrder`, and its position.

    The one implementation of what every training input shares: the order, the rows a process
    feeds, the position (epoch, examples taken) a checkpoint saves, and the wrap into the next
    epoch. A subclass says how the examples at given indices are read (`read`).

    The rows are this process's block of each global batch, unless `rows_fn` says which rows
    of a global batch of a given size it feeds (then `granularity` alone rounds a kept last
    batch). The other arguments are `EpochOrder`'s.
    """

    def __init__(self, num_examples: int, global_batch: int, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, shuffle: bool = True,
                 last_batch: str = 'drop', granularity: int = 1,
                 rows_fn: Optional[Callable[[int], np.ndarray]] = None):
        # Rows from `rows_fn` follow the mesh, whose batch shards `granularity` already counts
        # (processes that differ only along a tensor axis feed the same rows).
        self.order = EpochOrder(num_examples, global_batch, seed, shuffle, last_batch,
                                granularity, process_count if rows_fn is None else 1)
        self.rows_fn = rows_fn or functools.partial(process_rows, process_index=process_index,
                                                    process_count=process_count)
        self.state = IteratorState()

    @property
    def num_examples(self) -> int:
        return self.order.num_examples

    @property
    def steps_per_epoch(self) -> int:
        return self.order.steps_per_epoch

    @property
    def dropped_per_epoch(self) -> int:
        return self.order.dropped_per_epoch

    @property
    def last_size(self) -> int:
        return self.order.last_size

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The examples at `indices`, as arrays with a leading row dimension."""
        raise NotImplementedError

    def batch(self, epoch: int, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` of `epoch`."""
        return self.batch_at(epoch, step * self.order.global_batch)

    def batch_at(self, epoch: int, start: int) -> dict[str, np.ndarray]:
        """This process's rows of the global batch at position `start` of `epoch`."""
        rows = self.rows_fn(self.order.size_at(start))
        return self.read(self.order.examples_at(epoch, start, rows))

    def locate(self, state: IteratorState, k: int) -> tuple[int, int]:
        """(epoch, start position) of the k-th batch from position `state` (one with a batch
        left in its epoch): on in its epoch, then whole epochs from their start."""
        left = self.order.batches_from(state.example)
        if k < left:
            return state.epoch, state.example + k * self.order.global_batch
        epochs, step = divmod(k - left, self.steps_per_epoch)
        return state.epoch + 1 + epochs, step * self.order.global_batch

    def _next_batch(self) -> dict[str, np.ndarray]:
        """The batch at the current position (a subclass may have prepared it ahead)."""
        return self.batch_at(self.state.epoch, self.state.example)

    def get_state(self) -> dict[str, int]:
        return dataclasses.asdict(self.state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Goes to a saved position. A state without `example` (saved before positions were
        kept in examples) holds a batch index: read with this iterator's batch size, exact
        when the batch size is the one it was saved with."""
        self.close()
        epoch, step = int(state['epoch']), int(state['step'])
        example = int(state['example']) if 'example' in state else step * self.order.global_batch
        if min(epoch, step, example) < 0:
            raise ValueError(f'bad iterator state {dict(state)}')
        self.state = IteratorState(epoch, step, example)

    def close(self) -> None:
        """Releases what reads ahead (nothing here)."""

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.order.size_at(self.state.example) == 0:  # no batch left: the next epoch's start
            self.state = IteratorState(self.state.epoch + 1, 0, 0)
        at, out = self.state, self._next_batch()
        self.state = IteratorState(at.epoch, at.step + 1,
                                   at.example + self.order.size_at(at.example))
        return out


class BatchIterator(OrderedIterator):
    """Yields this process's block of each global batch of in-memory arrays.

    Args:
      arrays: numpy arrays with a leading example dimension N.
      The rest: as `OrderedIterator`.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], global_batch: int, **kwargs):
        self.arrays = dict(arrays)
        super().__init__(len(next(iter(self.arrays.values()))), global_batch, **kwargs)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[indices] for k, v in self.arrays.items()}
