"""Sequence packing: several sentences per encoder row, so a step computes no padding.

A training batch holds its sentences padded to `max_len` ([B, D, L]); on natural text most of
those tokens are padding (SNLI sentences at L=32: 43%). Packing lays the sentences out end to
end in rows of `pack_length` tokens (first fit, longest first) and describes the layout with two
index arrays, computed on the host. The batch's S shards (its split over the mesh's batch
axes: S contiguous blocks of examples) are packed each on its own, into R rows per shard, and
every index is local to its shard, so the encoder's gathers never cross devices:

  pack_index   [S, R, P] int32: for each packed slot of shard s, the flat index of its token
               in that shard's padded sentences [N/S * L] (N = B * V sentences, views
               repeated), or N/S * L for a slot that holds no token. The encoder gathers ids,
               token types and position ids through it, so positions restart in every
               sentence.
  unpack_index [B, V, L] int32: for each padded slot, the flat index of its packed slot in its
               shard's rows [R * P] (for padding, the sentence's own first slot).

Attention is restricted to the sentence (the source sentence of each slot), so every sentence
is encoded exactly as it is alone in its padded row; only the dropout masks differ (they are
drawn over the packed layout). R is rounded up to a multiple of `row_multiple`, so a run
compiles its step for a handful of shapes only.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import numpy as np

PACK_INDEX = 'pack_index'
UNPACK_INDEX = 'unpack_index'
PACKED_FIELDS = (PACK_INDEX, UNPACK_INDEX)


def _rows_for(bins: int, row_multiple: int) -> int:
    """Rows for `bins` filled bins: rounded up to a multiple of `row_multiple`, at least one."""
    return -(-max(bins, 1) // row_multiple) * row_multiple


def first_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins (lists of item indices) of total length <= capacity: first fit, longest first."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f'a sentence of {int(lengths.max())} tokens does not fit a packed row '
                         f'of {capacity}')
    bins: list[list[int]] = []
    free = np.zeros(len(lengths), np.int64)  # room left in each bin opened so far
    for i in np.argsort(-lengths, kind='stable'):
        n = int(lengths[i])
        fits = np.flatnonzero(free[:len(bins)] >= n)
        if len(fits):
            b = int(fits[0])
            bins[b].append(int(i))
        else:
            b = len(bins)
            bins.append([int(i)])
            free[b] = capacity
        free[b] -= n
    return bins


def pack_layout(lengths: np.ndarray, max_len: int, pack_length: int, row_multiple: int = 8,
                rows: int = 0, bins: Optional[list[list[int]]] = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """(pack_index [R, P], unpack_index [N, L]) for N sentences of `lengths` real tokens, each
    padded to `max_len` (one shard; see the module docstring). R: the rows needed rounded up to
    `row_multiple`, or `rows` when larger. `bins`: `first_fit(lengths, pack_length)`, when
    already computed."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    n = len(lengths)
    bins = first_fit(lengths, pack_length) if bins is None else bins
    rows = max(rows, _rows_for(len(bins), row_multiple))
    pack = np.full((rows, pack_length), n * max_len, np.int32)
    unpack = np.zeros((n, max_len), np.int32)
    for r, members in enumerate(bins):
        start = 0
        for s in sorted(members):  # sentences in input order within a row
            k = int(lengths[s])
            pack[r, start: start + k] = s * max_len + np.arange(k)
            # Padding positions read the sentence's own first slot: the poolers mask them, and
            # no other sentence's state is read (a NaN there would reach them as 0 x NaN).
            unpack[s] = r * pack_length + start
            unpack[s, :k] += np.arange(k)
            start += k
    return pack, unpack


def pack_batch(batch: Mapping[str, np.ndarray], views: int, pack_length: int, shards: int = 1,
               row_multiple: int = 8,
               agree: Callable[[int], int] = int) -> dict[str, np.ndarray]:
    """`batch` ([B, D, L] arrays, D = 1 or `views`; B a multiple of `shards`) plus its packed
    layout: PACK_INDEX [shards, R, pack_length] and UNPACK_INDEX [B, V, L], for the V
    sentences of each example as `jaxsim.train.step.encode_views` lays them out (a single
    sentence repeated V times, each copy packed on its own).

    `agree(rows) -> rows`: settles R among the processes that feed one global batch (each
    packs its own shards; `jaxsim.distributed.max_over_processes`)."""
    mask = np.asarray(batch['attention_mask'])
    examples, d, length = mask.shape
    lengths = mask.sum(-1)  # [B, D]
    if d == 1 and views > 1:
        lengths = np.repeat(lengths, views, axis=1)
    per_shard = lengths.reshape(shards, -1)  # shard s: examples [s B/S, (s+1) B/S)
    bins = [first_fit(x, pack_length) for x in per_shard]
    rows = agree(_rows_for(max(len(shard_bins) for shard_bins in bins), row_multiple))
    layouts = [pack_layout(x, length, pack_length, row_multiple, rows, shard_bins)
               for x, shard_bins in zip(per_shard, bins)]
    pack = np.stack([p for p, _ in layouts])
    unpack = np.concatenate([u for _, u in layouts]).reshape(examples, -1, length)
    return {**batch, PACK_INDEX: pack, UNPACK_INDEX: unpack}
