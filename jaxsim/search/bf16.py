"""Exact top-k search through a bfloat16 copy of the corpus, certified against float32.

The method of docs/search.md ("bfloat16 corpus"): per group of BF16_GROUP_ROWS rows the bf16
pass keeps its best score (with its row, in the score's low bits: `_order_key`) and its second
best; the best rows of the k + BF16_EXTRA_GROUPS best groups, and every row of BF16_FULL_GROUPS
of them, are rescored in float32. A query's result stands when its k-th float32 score beats
every row left out by more than `bf16_margin`; other queries go through a wider pass
(BF16_WIDE), then through the float32 search (`topk.top_k_search`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxsim.search.topk import (
    DEFAULT_QUERY_BATCH,
    Layout,
    query_batches,
    top_k_search,
)

# Rows per group (a power of two: the row within its group is packed into the score's low bits),
# groups kept per query beyond k, and chosen groups rescored whole (those whose second best row
# is highest: two top rows sharing a group are then still both rescored).
BF16_GROUP_ROWS = 8
BF16_EXTRA_GROUPS = 16
BF16_FULL_GROUPS = 2
# (extra groups, groups rescored whole) of the second pass over the queries the first could
# not certify (e.g. a query inside a dense cluster, its top scores closer than bf16's error).
BF16_WIDE = (64, 8)
_POS_BITS = BF16_GROUP_ROWS - 1


@dataclasses.dataclass(frozen=True)
class Bf16Norms:
    """Largest row norms of a corpus, each rounded up to float32: of the rows, of the rows
    rounded to bf16, and of the rounding errors (row - rounded row)."""

    rows: float
    rounded: float
    rounding: float


def bf16_corpus(vectors: np.ndarray, chunk: int = 65536) -> tuple[np.ndarray, Bf16Norms]:
    """Rows rounded to bfloat16 (nearest even) as their uint16 bit patterns, and their norms.

    Bit patterns, not a bf16 array: XLA:CPU upcasts a bf16 operand that is sliced inside a loop
    to float32 for the whole corpus (one full conversion per call); a uint16 slice bitcast to
    bf16 right before the product keeps the product in bf16 (XLA:CPU-specific).
    """
    import ml_dtypes  # a dependency of jax itself
    out = np.empty(vectors.shape, np.uint16)
    top = np.zeros(3)
    for start in range(0, len(vectors), chunk):
        part = vectors[start: start + chunk]
        low = part.astype(ml_dtypes.bfloat16)
        out[start: start + chunk] = low.view(np.uint16)
        wide, rounded = part.astype(np.float64), low.astype(np.float64)
        for i, x in enumerate((wide, rounded, wide - rounded)):
            top[i] = max(top[i], np.sqrt(np.einsum("ij,ij->i", x, x).max(initial=0.0)))
    return out, Bf16Norms(*(float(np.nextafter(np.float32(v), np.float32(np.inf))) for v in top))


def bf16_supported(layout: Layout, k: int, extra: int = BF16_EXTRA_GROUPS) -> bool:
    """Whether a device's rows hold enough whole groups for the bf16 pre-selection."""
    return (layout.block_rows % BF16_GROUP_ROWS == 0
            and layout.rows_per_device // BF16_GROUP_ROWS >= k + extra)


def bf16_margin(queries: jax.Array, norms: jax.Array) -> jax.Array:
    """[q] bound on |bf16 score - float32 score| of each query with any row, both as computed.

    With q~, x~ the bf16 roundings: q.x = q~.x~ - (q - q~).x~ - q.(x - x~), so by Cauchy-Schwarz
    |q~.x~ - q.x| <= |q - q~| |x~| + |q| |x - x~| (the actual rounding errors, ~0.4 x 2^-8 of the
    norms, where the per-element bound gives 2^-7). Each float32 sum of `dim` products errs by
    at most gamma = dim 2^-24 / (1 - dim 2^-24) times the sum of |products| <= the norms'
    product, for the bf16 sum and for any float32 evaluation of q.x. Then slack: the float32
    arithmetic of this bound, and denormals flushed to zero by bf16 instructions.
    `norms`: [rows, rounded, rounding] of `Bf16Norms`.
    """
    dim = queries.shape[1]
    rows, rounded, rounding = norms[0], norms[1], norms[2]
    _, low = bf16_round(queries)
    qn = jnp.linalg.norm(queries, axis=1)
    gamma = dim * 2.0 ** -24 / (1 - dim * 2.0 ** -24)
    bound = (jnp.linalg.norm(queries - low, axis=1) * rounded + qn * rounding
             + gamma * (jnp.linalg.norm(low, axis=1) * rounded + qn * rows))
    return bound * (1 + 4 * gamma + 2.0 ** -20) + dim * 2.0 ** -100 * (1 + qn) * (1 + rows)


def bf16_round(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 `x` rounded to bfloat16 (nearest even): as bf16, and the same values as float32.

    Integer arithmetic on the bits, not a convert pair a compiler allowed excess precision
    could drop: the product's query operand is exactly the one whose rounding error
    `bf16_margin` measures.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)
    low = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return low, jax.lax.bitcast_convert_type((bits >> 16) << 16, jnp.float32)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (NaN aside); its own inverse up to the bitcasts."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _from_key(key: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def group_of(layout: Layout, row: int) -> int:
    """The group (numbered along a device's rows) holding a device's `row`."""
    block, within = divmod(row, layout.block_rows)
    width = layout.block_rows // BF16_GROUP_ROWS
    return block * width + within % width


def _super_size(layout: Layout, kept: int) -> int:
    """Groups per supergroup: the largest of 32, 16, ..., 1 dividing a block's groups that
    leaves at least `kept` supergroups a device."""
    groups = layout.block_rows // BF16_GROUP_ROWS
    for size in (32, 16, 8, 4, 2):
        if groups % size == 0 and layout.blocks * (groups // size) >= kept:
            return size
    return 1


@functools.lru_cache(maxsize=64)
def bf16_search_fn(mesh: Mesh, layout: Layout, k: int, extra: int = BF16_EXTRA_GROUPS,
                   full: int = BF16_FULL_GROUPS):
    """A jitted `(corpus_f32, corpus_bf16_bits, n_valid, norms, queries) -> (scores, rows,
    certain)`: the float32 top k of the candidates and whether it is certified (module doc);
    `extra` groups kept beyond k, `full` of them rescored whole."""
    axes = tuple(mesh.axis_names)
    g, kept = BF16_GROUP_ROWS, k + extra
    # A block's group j holds its rows j, j + width, ..., j + 7 width (width = block / 8), so
    # group maxima are elementwise maxima of 8 contiguous slices (vectorized on CPU); likewise
    # supergroup s holds groups s, s + supers, ... .
    width = layout.block_rows // g
    size = _super_size(layout, kept)
    supers = width // size
    dims = (((1,), (1,)), ((), ()))
    lowest = np.iinfo(np.int32).min

    def local(corpus, bits, n_valid, queries):
        first_row = jax.lax.axis_index(axes) * layout.rows_per_device
        blocks = bits.reshape(layout.blocks, layout.block_rows, layout.dim)
        starts = first_row + jnp.arange(layout.blocks, dtype=jnp.int32) * layout.block_rows
        q = queries.shape[0]
        low, _ = bf16_round(queries)
        member = jnp.arange(g, dtype=jnp.int32)
        columns = jnp.arange(width, dtype=jnp.int32)
        none = _order_key(jnp.float32(-jnp.inf))

        def best_two(block_and_start):
            block, start = block_and_start
            block = jax.lax.bitcast_convert_type(block, jnp.bfloat16)
            scores = jax.lax.dot_general(low, block, dims, preferred_element_type=jnp.float32)
            # The member number replaces the key's low bits: one integer max gives the best
            # score (to 8 units in the last place, allowed for by `_upper`) and its row.
            key = (_order_key(scores).reshape(q, g, width) & ~_POS_BITS) | member[:, None]
            best = key.max(axis=1)
            second = jnp.where(key == best[:, None, :], lowest, key).max(axis=1)
            # Groups wholly past the valid rows drop out; padding rows inside a group score 0,
            # which can only raise the bounds, never leave a valid row out.
            valid = start + columns < n_valid
            best, second = jnp.where(valid, best, none), jnp.where(valid, second, none)
            return best, second, best.reshape(q, size, supers).max(axis=1)

        # [blocks, q, width] (never transposed: only the chosen entries are read) and
        # [q, blocks * supers].
        best, second, tops = jax.lax.map(best_two, (blocks, starts))
        tops = jnp.moveaxis(tops, 0, 1).reshape(q, -1)
        # Exact top `kept` groups through supergroup maxima (as `topk._grouped_top_k`): a group
        # beating the kept-th is either in a chosen supergroup or its supergroup would beat one.
        # Indices only: XLA:CPU sorts whole rows when TopK's values are used too (5x the time).
        _, chosen = jax.lax.top_k(_from_key(tops), kept)
        block_of = jnp.repeat(chosen // supers, size, axis=1)  # [q, kept * size]
        column = ((chosen % supers)[:, :, None] + jnp.arange(size) * supers).reshape(q, -1)
        query = jnp.arange(q)[:, None]
        _, pick = jax.lax.top_k(_from_key(best[block_of, query, column]), kept)
        block_of = jnp.take_along_axis(block_of, pick, axis=1)  # [q, kept]: the chosen groups
        column = jnp.take_along_axis(column, pick, axis=1)
        chosen_best = best[block_of, query, column]
        first = block_of * layout.block_rows + column  # each chosen group's first row
        tops = first + (chosen_best & _POS_BITS) * width  # and its best row
        seconds, which = jax.lax.top_k(_upper(second[block_of, query, column]), full + 1)
        # Rows left out: in a group left out (<= the lowest chosen maximum) or, in a chosen
        # group, not its best row and not in a group rescored whole (<= the next second best).
        threshold = jnp.maximum(_upper(chosen_best.min(axis=1)), seconds[:, full])
        whole = (jnp.take_along_axis(first, which[:, :full], axis=1)[:, :, None]
                 + member * width)
        again = whole == jnp.take_along_axis(tops, which[:, :full], axis=1)[:, :, None]
        rows = jnp.concatenate([tops, jnp.where(again, layout.rows_per_device,
                                                whole).reshape(q, -1)], axis=1)
        rows = jnp.sort(rows, axis=1)  # row order (ties lowest row first), duplicates last
        gathered = corpus[jnp.minimum(rows, layout.rows_per_device - 1)]
        exact = jnp.einsum("qd,qcd->qc", queries, gathered, precision=jax.lax.Precision.HIGHEST)
        rows = rows + first_row
        exact = jnp.where((rows < n_valid) & (rows < first_row + layout.rows_per_device),
                          exact, -jnp.inf)
        top, pos = jax.lax.top_k(exact, k)
        return top, jnp.take_along_axis(rows, pos, axis=1), threshold[:, None]

    per_device = jax.shard_map(local, mesh=mesh,
                               in_specs=(P(axes, None), P(axes, None), P(), P()),
                               out_specs=(P(None, axes), P(None, axes), P(None, axes)))

    def search(corpus, bits, n_valid, norms, queries):
        scores, rows, thresholds = per_device(corpus, bits, n_valid, queries)
        top, pos = jax.lax.top_k(scores, k)
        limit = thresholds.max(axis=1)
        # 2^-22 |limit|: the float32 sum below may round down.
        limit = limit + bf16_margin(queries, norms) + 2.0 ** -22 * jnp.abs(limit)
        return top, jnp.take_along_axis(rows, pos, axis=1), top[:, k - 1] > limit

    return jax.jit(search)


def _upper(key: jax.Array) -> jax.Array:
    """The largest float32 a packed key may stand for (its low bits were the row's)."""
    return _from_key(key | _POS_BITS)


def bf16_top_k_search(corpus: jax.Array, bits: jax.Array, norms: Bf16Norms, layout: Layout,
                      mesh: Mesh, n_valid: int, queries: np.ndarray, k: int, *,
                      query_batch: int = DEFAULT_QUERY_BATCH,
                      stats: Optional[dict] = None) -> tuple[np.ndarray, np.ndarray]:
    """`topk.top_k_search`'s result, scoring `bits` (`bf16_corpus`, placed like `corpus`) first.

    Queries a pass cannot certify go on to the wider pass, then to float32 (all of them when the
    corpus is too small for the bf16 pass); `stats` gets their counts, "bf16_again" and
    "float32_again".
    """
    if not 1 <= k <= n_valid:
        raise ValueError(f"k must be in [1, {n_valid}], got {k}")
    scores = np.empty((len(queries), k), np.float32)
    found = np.empty((len(queries), k), np.int64)
    again = np.arange(len(queries))
    stats = {} if stats is None else stats
    stats["bf16_again"] = 0
    norm_args = np.array([norms.rows, norms.rounded, norms.rounding], np.float32)
    for extra, full in ((BF16_EXTRA_GROUPS, BF16_FULL_GROUPS), BF16_WIDE):
        if not len(again) or not bf16_supported(layout, k, extra):
            break
        if extra != BF16_EXTRA_GROUPS:
            stats["bf16_again"] = len(again)
        fn = bf16_search_fn(mesh, layout, k, extra, full)
        scores[again], found[again], certain = query_batches(
            lambda x: fn(corpus, bits, np.int32(n_valid), norm_args, x), queries[again],
            query_batch, layout.dim, ((k,), np.float32), ((k,), np.int64), ((), bool))
        again = again[~certain]
    stats["float32_again"] = len(again)
    if len(again):
        scores[again], found[again] = top_k_search(corpus, layout, mesh, n_valid,
                                                   queries[again], k, query_batch=query_batch)
    return scores, found
