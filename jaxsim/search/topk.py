"""Exact top-k inner-product search over a corpus sharded by rows across a device mesh.

The corpus [capacity, dim] is cut into equal contiguous row ranges, one per device of the mesh
(`NamedSharding(mesh, P(<every mesh axis>, None))`), so a corpus larger than one device's memory
still searches exactly. Each device scans its rows block by block: it scores a block
([queries, block_rows], never [queries, rows]), selects the block's top k (through group maxima,
`_grouped_top_k`, when the block is large enough) and merges it into a running top-k per query.
The per-device lists are then merged into the global top-k. Rows past the valid count (padding
that makes the shards equal) score -inf and come back with row -1 or a row >= the valid count,
which callers drop.

Ties: `lax.top_k` puts the lower position first. Candidates are always laid out in row order
(the running list before each new block, device shards in row order), so equal scores come out
lowest row first whatever the device count or block size.

Optionally each block's selection uses `lax.approx_max_k` (fast on TPU; elsewhere XLA may lower
it to an exact selection); recall against the exact search is measured by
benchmarks/search_speed.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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


def row_axes(mesh: Mesh) -> tuple[str, ...]:
    """Rows are split over every axis of the mesh: a search has no other dimension to shard."""
    return tuple(mesh.axis_names)


def corpus_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(row_axes(mesh), None))


def place_corpus(vectors: np.ndarray, mesh: Mesh, layout: Layout) -> jax.Array:
    """Copies `vectors` [rows, dim] to the mesh as a [capacity, dim] row-sharded array.

    Each device receives only its own row range (zero-padded past the end of `vectors`), so the
    host never builds the padded [capacity, dim] copy.
    """
    capacity, dim = layout.capacity, layout.dim

    def shard(index):
        start, stop, _ = index[0].indices(capacity)
        if stop <= len(vectors):
            return vectors[start:stop]
        out = np.zeros((stop - start, dim), vectors.dtype)
        part = vectors[start:stop]
        out[: len(part)] = part
        return out

    return jax.make_array_from_callback((capacity, dim), corpus_sharding(mesh), shard)


@functools.lru_cache(maxsize=64)
def search_fn(mesh: Mesh, layout: Layout, k: int, recall_target: Optional[float] = None):
    """A jitted `(corpus [capacity, dim], n_valid int32, queries [q, dim]) -> (scores, rows)`.

    scores [q, k] float32 descending, rows [q, k] int32 global row numbers. Compiled once per
    (mesh, layout, k, recall_target, q); `n_valid` is traced, so adding rows that fit the
    capacity does not recompile.
    """
    axes = row_axes(mesh)

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
            scores = jnp.where(rows[None, :] < n_valid, scores, -jnp.inf)
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


# bfloat16 corpus: rows per group whose maximum bf16 score is kept, groups kept per query beyond
# k, and the bound on |bf16 score - float32 score| per unit of |query| * |row|: rounding both
# sides to bf16 (8-bit significand) moves each product by at most 2^-8 of |q_i x_i|, and the
# float32 sums of dim terms differ by at most dim * 2^-23 of the same total (2^-22: margin).
BF16_GROUP_ROWS = 8
BF16_EXTRA_GROUPS = 16


def bf16_error_bound(dim: int) -> float:
    return 2.0 ** -8 + dim * 2.0 ** -22


def bf16_supported(layout: Layout, k: int) -> bool:
    """Whether a device's rows hold enough whole groups for the bf16 pre-selection."""
    return (layout.block_rows % BF16_GROUP_ROWS == 0
            and layout.rows_per_device // BF16_GROUP_ROWS >= k + BF16_EXTRA_GROUPS)


def as_bf16_bits(vectors: np.ndarray) -> np.ndarray:
    """Rows rounded to bfloat16 (nearest even), stored as their uint16 bit patterns.

    Bit patterns, not a bf16 array: XLA:CPU upcasts a bf16 operand that is sliced inside a loop
    to float32 for the whole corpus (one full conversion per call); a uint16 slice bitcast to
    bf16 right before the product keeps the product in bf16 (XLA:CPU-specific).
    """
    import ml_dtypes  # a dependency of jax itself
    out = np.empty(vectors.shape, np.uint16)
    for start in range(0, len(vectors), 65536):
        out[start: start + 65536] = vectors[start: start + 65536].astype(
            ml_dtypes.bfloat16).view(np.uint16)
    return out


@functools.lru_cache(maxsize=64)
def bf16_search_fn(mesh: Mesh, layout: Layout, k: int):
    """A jitted `(corpus_f32, corpus_bf16_bits, n_valid, bound, queries) -> (scores, rows, exact)`.

    Each device scores its rows in bfloat16 (float32 sums), keeps the maximum of every group
    of BF16_GROUP_ROWS rows, and picks the k + BF16_EXTRA_GROUPS best groups per query; their
    rows are scored again in float32 and the k best kept. `exact[q]` says the result equals the
    float32 search's: the k-th float32 score beats the bf16 maximum of every group left out by
    more than `bound` * |query| (`bound` = bf16_error_bound(dim) * the largest row norm), so no
    row left out can reach it. Callers search the other queries again in float32.
    """
    axes = row_axes(mesh)
    g, kept = BF16_GROUP_ROWS, k + BF16_EXTRA_GROUPS
    dims = (((1,), (1,)), ((), ()))

    def local(corpus, bits, n_valid, queries):
        first_row = jax.lax.axis_index(axes) * layout.rows_per_device
        blocks = bits.reshape(layout.blocks, layout.block_rows, layout.dim)
        q = queries.shape[0]
        low = queries.astype(jnp.bfloat16)

        def group_max(block):
            block = jax.lax.bitcast_convert_type(block, jnp.bfloat16)
            scores = jax.lax.dot_general(low, block, dims, preferred_element_type=jnp.float32)
            return scores.reshape(q, layout.block_rows // g, g).max(axis=2)

        maxima = jnp.moveaxis(jax.lax.map(group_max, blocks), 0, 1).reshape(q, -1)
        groups = jnp.arange(maxima.shape[1], dtype=jnp.int32)
        # Groups wholly past the valid rows drop out; padding rows inside a group score 0, which
        # can only keep the group in, never leave a valid row out.
        maxima = jnp.where(first_row + groups * g < n_valid, maxima, -jnp.inf)
        # Indices only: XLA:CPU sorts whole rows when TopK's values are used too (5x the time).
        _, chosen = jax.lax.top_k(maxima, kept)
        # No group left out has a higher maximum than the lowest chosen one.
        left_out = jnp.take_along_axis(maxima, chosen, axis=1).min(axis=1)
        chosen = jnp.sort(chosen, axis=1)  # row order: ties lowest row first
        rows = (chosen[:, :, None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(q, kept * g)
        exact = jnp.einsum("qd,qcd->qc", queries, corpus[rows],
                           precision=jax.lax.Precision.HIGHEST)
        rows = rows + first_row
        exact = jnp.where(rows < n_valid, exact, -jnp.inf)
        best, pos = jax.lax.top_k(exact, k)
        return best, jnp.take_along_axis(rows, pos, axis=1), left_out[:, None]

    per_device = jax.shard_map(local, mesh=mesh,
                               in_specs=(P(axes, None), P(axes, None), P(), P()),
                               out_specs=(P(None, axes), P(None, axes), P(None, axes)))

    def search(corpus, bits, n_valid, bound, queries):
        scores, rows, left_out = per_device(corpus, bits, n_valid, queries)
        top, pos = jax.lax.top_k(scores, k)
        margin = bound * jnp.linalg.norm(queries, axis=1)
        certain = top[:, k - 1] > left_out.max(axis=1) + margin
        return top, jnp.take_along_axis(rows, pos, axis=1), certain

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
                 recall_target: Optional[float] = None, bf16_bits: Optional[jax.Array] = None,
                 bf16_bound: float = 0.0,
                 stats: Optional[dict] = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows of `corpus` by inner product with each query.

    Args:
      corpus: the placed corpus (`place_corpus`).
      layout: its layout.
      mesh: the mesh it lives on.
      n_valid: rows in use (rows at and past it are padding).
      queries: [q, dim] float32.
      k: results per query, 1 <= k <= n_valid.
      query_batch: queries per jitted call.
      recall_target: None for the exact search, else `approx_max_k`'s recall target.
      bf16_bits: the corpus as bfloat16 bits (`as_bf16_bits`, placed like `corpus`): score in
        bfloat16 first (`bf16_search_fn`); the result is still the float32 search's.
      bf16_bound: `bf16_error_bound(dim)` times the largest row norm.
      stats: if given, gets "float32_again": queries the bf16 pass could not certify.

    Returns:
      (scores [q, k] float32, rows [q, k] int64), best first, ties lowest row first.
    """
    if not 1 <= k <= n_valid:
        raise ValueError(f"k must be in [1, {n_valid}], got {k}")
    scores = np.empty((len(queries), k), np.float32)
    found = np.empty((len(queries), k), np.int64)
    again = np.arange(len(queries))
    if bf16_bits is not None and recall_target is None and bf16_supported(layout, k):
        fn = bf16_search_fn(mesh, layout, k)
        results = _run_batches(lambda x: fn(corpus, bf16_bits, np.int32(n_valid),
                                            np.float32(bf16_bound), x),
                               queries, query_batch, layout.dim)
        certain = np.empty(len(queries), bool)
        _collect(results, scores, found, certain)
        again = np.flatnonzero(~certain)
    if stats is not None:
        stats["float32_again"] = len(again)
    if len(again):
        fn = search_fn(mesh, layout, k, recall_target)
        results = _run_batches(lambda x: fn(corpus, np.int32(n_valid), x),
                               queries[again], query_batch, layout.dim)
        part_scores = np.empty((len(again), k), np.float32)
        part_rows = np.empty((len(again), k), np.int64)
        _collect(results, part_scores, part_rows)
        scores[again], found[again] = part_scores, part_rows
    return scores, found


def _run_batches(fn, queries: np.ndarray, query_batch: int, dim: int) -> list:
    """Dispatches every chunk before fetching any, so host transfers overlap device work."""
    pending = []
    for start in range(0, len(queries), query_batch):
        chunk = queries[start: start + query_batch]
        padded = np.zeros((_bucket(len(chunk), query_batch), dim), np.float32)
        padded[: len(chunk)] = chunk
        pending.append((len(chunk), fn(padded)))
    return pending


def _collect(pending: list, *outs: np.ndarray) -> None:
    at = 0
    for n, results in pending:
        for out, result in zip(outs, results):
            out[at: at + n] = np.asarray(result)[:n]
        at += n
