"""How `jaxsim.encode` lays a chunk of tokenized sentences out in batches (planned on the host).

Sentences are sorted by token length and each batch is padded to a length bucket
(`bucket_length`), every batch of a bucket with the same row count: one compiled shape per
bucket, and sorted sentences of similar length pad little.

On CPU devices a batch holds at most `CPU_TOKENS_PER_BATCH` padded tokens per batch shard
(long buckets get fewer rows). XLA:CPU runs each layer's products and elementwise work over
the whole batch, so the [tokens, 4 * hidden] float32 intermediate of a 64 x 128 batch (50 MB
for MiniLM) streams through memory, where ~1,024 tokens stay in cache (figures:
docs/performance.md). Accelerators want big batches: they keep `batch_size` rows.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from jax.sharding import Mesh

from jaxsim.data.tokenize import TokenBatch, bucket_length, pad_batch

CPU_TOKENS_PER_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a chunk.

    Attributes:
      indices: [rows] the chunk index of the sentence in each padded row, -1 for a padding row.
      tokens: the sentences padded, [rows, length].
    """

    indices: np.ndarray
    tokens: TokenBatch


def token_budget(mesh: Mesh, shards: int) -> Optional[int]:
    """Padded tokens per global batch at most: `CPU_TOKENS_PER_BATCH` per batch shard on CPU
    devices, None (no limit) on accelerators."""
    if any(d.platform != "cpu" for d in mesh.devices.flat):
        return None
    return CPU_TOKENS_PER_BATCH * shards


def rows_per_batch(length: int, batch_size: int, shards: int, budget: Optional[int]) -> int:
    """Rows of a batch of `length` tokens a row: `batch_size` (a multiple of `shards`), cut to
    the token budget when there is one, never below `shards` rows."""
    if budget is None:
        return batch_size
    return min(batch_size, max(shards, budget // length // shards * shards))


def plan_batches(ids: Sequence[Sequence[int]], pad_id: int, batch_size: int, max_length: int,
                 shards: int = 1, budget: Optional[int] = None) -> list[Batch]:
    """The batches of a chunk of token id lists, in length order."""
    lengths = np.array([len(s) for s in ids], np.int64)
    order = np.argsort(lengths, kind="stable")
    batches, b = [], 0
    while b < len(order):
        # Sorted ascending, so fewer rows never need a longer bucket: shrink until the rows
        # fit their own bucket's row count.
        n = batch_size
        while True:
            length = bucket_length(int(lengths[order[b: b + n]].max()), max_length)
            rows = rows_per_batch(length, batch_size, shards, budget)
            if rows >= n:
                break
            n = rows
        picked = order[b: b + n]
        indices = np.full(rows, -1, np.int64)
        indices[: len(picked)] = picked
        batches.append(Batch(indices, pad_batch([ids[i] for i in picked], pad_id, length,
                                                rows=rows)))
        b += n
    return batches
