"""Exact top-k inner-product search over a corpus sharded by rows across a device mesh.

Each device holds an equal contiguous range of rows (`place_corpus`) and scans it block by
block, merging each block's top k (through group maxima, `_grouped_top_k`, for large blocks)
into a running top-k; the per-device lists are then merged. Padding rows score -inf and come
back as row -1 or a row >= the valid count, which callers drop.

Ties: `lax.top_k` puts the lower position first, and candidates are always laid out in row
order (the running list before each new block, device shards in row order), so equal scores
come out lowest row first whatever the device count or block size. A `recall_target` selects
with `lax.approx_max_k` instead (its recall: benchmarks/search_speed.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Rows scored per scan step on each device: [queries, block] scores stay cache-sized on CPU.
DEFAULT_BLOCK_ROWS = 2048
# Queries per jitted call; smaller query counts are padded up to a power of two (>= 8) so a
# handful of shapes compile, once each.
DEFAULT_QUERY_BATCH = 256


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a corpus of width `dim` sits: per device, `blocks` blocks of `block_rows` rows."""

    devices: int
    block_rows: int
    blocks: int
    dim: int

    @property
    def rows_per_device(self) -> int:
        return self.block_rows * self.blocks

    @property
    def capacity(self) -> int:
        return self.rows_per_device * self.devices


def plan_layout(rows: int, dim: int, devices: int,
                block_rows: int = DEFAULT_BLOCK_ROWS) -> Layout:
    """The smallest layout holding `rows` rows: equal shards, whole blocks, rows padded to 8."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    per_device = max(1, math.ceil(rows / devices))
    block = min(block_rows, -(-per_device // 8) * 8)
    return Layout(devices=devices, block_rows=block, blocks=math.ceil(per_device / block), dim=dim)


def place_corpus(vectors: np.ndarray, mesh: Mesh, layout: Layout) -> jax.Array:
    """Copies `vectors` [rows, dim] to the mesh as a [capacity, dim] row-sharded array.

    Each device receives only its own row range (zero-padded past the end of `vectors`), so the
    host never builds the padded [capacity, dim] copy.
    """
    def shard(index):
        start, stop, _ = index[0].indices(layout.capacity)
        part = vectors[start:stop]
        return part if len(part) == stop - start else np.pad(
            part, ((0, stop - start - len(part)), (0, 0)))

    return jax.make_array_from_callback((layout.capacity, layout.dim),
                                        NamedSharding(mesh, P(tuple(mesh.axis_names), None)), shard)


@functools.lru_cache(maxsize=64)
def search_fn(mesh: Mesh, layout: Layout, k: int, recall_target: Optional[float] = None):
    """A jitted `(corpus [capacity, dim], n_valid int32, queries [q, dim]) -> (scores, rows)`.

    scores [q, k] float32 descending, rows [q, k] int32 global row numbers. Compiled once per
    (mesh, layout, k, recall_target, q); `n_valid` is traced, so adding rows that fit the
    capacity does not recompile.
    """
    axes = tuple(mesh.axis_names)  # rows split over every mesh axis: nothing else to shard

    block_k = min(k, layout.block_rows)  # a block contributes at most its own rows
    group = _group_size(layout.block_rows, block_k)

    def local_top_k(corpus, n_valid, queries):
        # corpus: this device's [rows_per_device, dim]; queries: all of them, [q, dim].
        first_row = jax.lax.axis_index(axes) * layout.rows_per_device
        blocks = corpus.reshape(layout.blocks, layout.block_rows, layout.dim)
        starts = first_row + jnp.arange(layout.blocks, dtype=jnp.int32) * layout.block_rows
        q = queries.shape[0]
        offsets = jnp.arange(layout.block_rows, dtype=jnp.int32)

        def step(best, block_and_start):
            block, start = block_and_start
            rows = start + offsets  # [block]
            # HIGHEST: float32 products on every backend (GPUs/TPUs default to lower precision).
            scores = jnp.dot(queries, block.T, precision=jax.lax.Precision.HIGHEST)  # [q, block]
            # Only a block that reaches past the valid rows needs the mask (most blocks do
            # not): the others skip a pass over their scores.
            scores = jax.lax.cond(start + layout.block_rows > n_valid,
                                  lambda s: jnp.where(rows[None, :] < n_valid, s, -jnp.inf),
                                  lambda s: s, scores)
            if recall_target is not None:
                top, pos = jax.lax.approx_max_k(scores, block_k, recall_target=recall_target)
            elif group:
                top, pos = _grouped_top_k(scores, block_k, group)
            else:
                top, pos = jax.lax.top_k(scores, block_k)
            # Merge into the running list; it holds lower rows, so it goes first (ties).
            cand_scores = jnp.concatenate([best[0], top], axis=1)  # [q, k + block_k]
            cand_rows = jnp.concatenate([best[1], start + pos], axis=1)
            top, pos = jax.lax.top_k(cand_scores, k)
            return (top, jnp.take_along_axis(cand_rows, pos, axis=1)), None

        init = (jnp.full((q, k), -jnp.inf, jnp.float32), jnp.full((q, k), -1, jnp.int32))
        # The carry differs per device (it holds this device's rows): mark it so for scan.
        init = jax.lax.pcast(init, axes, to="varying")
        best, _ = jax.lax.scan(step, init, (blocks, starts))
        return best

    per_device = jax.shard_map(local_top_k, mesh=mesh,
                               in_specs=(P(axes, None), P(), P()),
                               out_specs=(P(None, axes), P(None, axes)))

    def search(corpus, n_valid, queries):
        scores, rows = per_device(corpus, n_valid, queries)  # [q, devices * k], in row order
        top, pos = jax.lax.top_k(scores, k)
        return top, jnp.take_along_axis(rows, pos, axis=1)

    return jax.jit(search)


def _group_size(block_rows: int, k: int) -> int:
    """Rows per group for `_grouped_top_k` (0: select over the whole block instead).

    The largest of 32/16/8 that divides the block into at least 2k groups: fewer groups
    would leave little to skip.
    """
    for size in (32, 16, 8):
        if block_rows % size == 0 and block_rows // size >= 2 * k:
            return size
    return 0


def _grouped_top_k(scores: jax.Array, k: int, group: int) -> tuple[jax.Array, jax.Array]:
    """Exact `lax.top_k(scores, k)` (ties: lower position first) through group maxima.

    XLA:CPU's TopK costs about as much as the block's matmul when run over every score. Here
    it runs over the [q, block/group] group maxima and then over the k*group scores of the
    k best groups only. Exact: a group holding one of the top k (in the order value desc,
    position asc) has a maximum that beats, or ties at a lower position, that of every group
    holding none, so it is among the k best groups; gathering the chosen groups in position
    order keeps ties lowest position first.
    """
    q, n = scores.shape
    groups = scores.reshape(q, n // group, group)
    _, chosen = jax.lax.top_k(groups.max(axis=2), k)  # [q, k] group numbers
    chosen = jnp.sort(chosen, axis=1)
    cand = jnp.take_along_axis(groups, chosen[:, :, None], axis=1).reshape(q, k * group)
    top, pos = jax.lax.top_k(cand, k)
    positions = (chosen[:, :, None] * group + jnp.arange(group, dtype=jnp.int32)).reshape(q, -1)
    return top, jnp.take_along_axis(positions, pos, axis=1)


def _bucket(n: int, limit: int) -> int:
    """Query rows per call: the next power of two >= n (at least 8), capped at `limit`."""
    return min(limit, max(8, 1 << (n - 1).bit_length()))


def top_k_search(corpus: jax.Array, layout: Layout, mesh: Mesh, n_valid: int,
                 queries: np.ndarray, k: int, *, query_batch: int = DEFAULT_QUERY_BATCH,
                 recall_target: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows of `corpus` (placed by `place_corpus`, its first `n_valid` rows in use) by
    inner product with each query [q, dim], 1 <= k <= n_valid.

    Returns:
      (scores [q, k] float32, rows [q, k] int64), best first, ties lowest row first.
    """
    if not 1 <= k <= n_valid:
        raise ValueError(f"k must be in [1, {n_valid}], got {k}")
    fn = search_fn(mesh, layout, k, recall_target)
    return query_batches(lambda x: fn(corpus, np.int32(n_valid), x), queries, query_batch,
                         layout.dim, ((k,), np.float32), ((k,), np.int64))


def query_batches(fn, queries: np.ndarray, query_batch: int, dim: int,
                  *outs: tuple[tuple, type]) -> list[np.ndarray]:
    """`fn`'s outputs for `queries`, called in chunks of `query_batch` rows.

    Each chunk is zero-padded to a power of two rows (`_bucket`), so few shapes compile.
    Every chunk is dispatched before any result is fetched, so host transfers overlap device
    work. `outs`: the (shape per query, dtype) of each output of `fn`.
    """
    pending = []
    for start in range(0, len(queries), query_batch):
        chunk = queries[start: start + query_batch]
        padded = np.zeros((_bucket(len(chunk), query_batch), dim), np.float32)
        padded[: len(chunk)] = chunk
        pending.append((start, len(chunk), fn(padded)))
    joined = [np.empty((len(queries), *shape), dtype) for shape, dtype in outs]
    for start, n, results in pending:
        for out, result in zip(joined, results):
            out[start: start + n] = np.asarray(result)[:n]
    return joined
