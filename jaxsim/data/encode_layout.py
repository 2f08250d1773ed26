"""How `jaxsim.encode` lays a chunk of tokenized sentences out in batches (planned on the host).

Two layouts; each chunk takes the one that computes fewer token slots:

  padded  sentences sorted by token length, each batch padded to a length bucket
          (`bucket_length`), every batch of a bucket the same row count: one compiled shape
          per bucket. Sorted sentences of similar length (long texts) pad little.
  packed  sentences laid end to end in rows of `row_length` tokens (the bucket of the chunk's
          longest sentence; first fit, longest first), attention kept within each sentence
          (`jaxsim.models.packed`): the same vectors up to float rounding. Short sentences of
          mixed lengths fill the rows almost completely: STS-B test's 2,551 sentences
          (8-46 tokens) take 37,296 slots packed against 43,272 padded. A chunk compiles one
          shape.

The packed layout is taken only when it saves at least `PACK_SAVING` of the padded layout's
slots: its rows are longer than most padded batches', so each token's attention row is too.

A packed batch holds the rows of S batch shards (its split over the mesh), each shard's rows
packed from its own sentences, every index local to the shard (as `jaxsim.data.packing` lays
out a training batch), so the encoder's gathers never cross devices. Its sentences are also
given padded to `row_length` ([S * K, row_length], K sentences a shard at most): the encoder
gathers its packed rows from them and returns one vector per padded row.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from jaxsim.data.packing import first_fit, pack_layout
from jaxsim.data.tokenize import TokenBatch, bucket_length, pad_batch

# Pack a chunk when that saves at least this fraction of the padded layout's slots.
PACK_SAVING = 0.1
# Sentences a shard of a packed batch holds at least (rounded up to the length-bucket grid,
# so a run compiles few shapes).
_MIN_SENTENCES = 8


@dataclasses.dataclass(frozen=True)
class Batch:
    """One batch of a chunk.

    Attributes:
      indices: [rows] the chunk index of the sentence in each padded row, -1 for a padding row.
      tokens: the sentences padded, [rows, length].
      packing: None (padded layout), or (pack_index [S, R, P], unpack_index [rows, P]) for
        `SentenceEncoder(..., packing=)`.
    """

    indices: np.ndarray
    tokens: TokenBatch
    packing: Optional[tuple[np.ndarray, np.ndarray]] = None


def rows_per_batch(length: int, batch_size: int, shards: int, budget: Optional[int]) -> int:
    """Rows of a batch of `length` tokens a row: `batch_size` (a multiple of `shards`), cut to
    the token budget when there is one, never below `shards` rows."""
    if budget is None:
        return batch_size
    return min(batch_size, max(shards, budget // length // shards * shards))


def padded_plan(lengths: np.ndarray, batch_size: int, max_length: int, shards: int,
                budget: Optional[int]) -> list[tuple[np.ndarray, int, int]]:
    """[(sentence indices, bucket length, rows)] of the padded layout, in length order."""
    order = np.argsort(lengths, kind="stable")
    plan, b = [], 0
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
        plan.append((order[b: b + n], length, rows))
        b += n
    return plan


@dataclasses.dataclass(frozen=True)
class PackedPlan:
    """The packed layout of a chunk: `batches[b][s]` lists the rows (each a list of sentence
    indices) of shard s of batch b."""

    batches: list
    row_length: int
    rows_per_shard: int
    sentences_per_shard: int

    @property
    def slots(self) -> int:
        shards = len(self.batches[0]) if self.batches else 0
        return len(self.batches) * shards * self.rows_per_shard * self.row_length


def packed_plan(lengths: np.ndarray, batch_size: int, max_length: int, shards: int,
                budget: Optional[int]) -> PackedPlan:
    """Rows of the chunk's longest bucket, filled first fit (longest first), dealt out to the
    batches' shards so that every shard holds about as many rows and sentences (that count,
    rounded up, is each shard's padded row count)."""
    row_length = bucket_length(int(lengths.max()), max_length)
    bins = first_fit(lengths, row_length)
    # As few batches as the row limit allows, their rows spread evenly (the last batch is not
    # left mostly empty).
    most_rows = rows_per_batch(row_length, batch_size, shards, budget) // shards
    count = -(-len(bins) // (most_rows * shards))
    # Rows a shard: a power of two (few shapes to compile for small inputs), at most the limit.
    per_shard = min(most_rows, 1 << (-(-len(bins) // (count * shards)) - 1).bit_length())
    groups: list[list] = [[] for _ in range(count * shards)]
    # Fullest rows first, dealt back and forth over the shards: about even sentence counts,
    # never more than `per_shard` rows a shard.
    for j, i in enumerate(sorted(range(len(bins)), key=lambda i: -len(bins[i]))):
        turn, position = divmod(j, len(groups))
        groups[position if turn % 2 == 0 else len(groups) - 1 - position].append(bins[i])
    most = max(sum(len(row) for row in group) for group in groups)
    per_shard_sentences = bucket_length(max(most, _MIN_SENTENCES), 1 << 30)
    batches = [groups[b: b + shards] for b in range(0, len(groups), shards)]
    return PackedPlan(batches, row_length, per_shard, per_shard_sentences)


def padded_slots(plan: Sequence[tuple[np.ndarray, int, int]]) -> int:
    return sum(length * rows for _, length, rows in plan)


def plan_batches(ids: Sequence[Sequence[int]], pad_id: int, batch_size: int, max_length: int,
                 shards: int = 1, budget: Optional[int] = None,
                 pack: bool = True) -> list[Batch]:
    """The batches of a chunk of token id lists, in either layout (see the module docstring);
    `pack=False` keeps the padded one."""
    lengths = np.array([len(s) for s in ids], np.int64)
    if not len(lengths):
        return []
    padded = padded_plan(lengths, batch_size, max_length, shards, budget)
    if pack:
        packed = packed_plan(lengths, batch_size, max_length, shards, budget)
        if packed.slots <= (1.0 - PACK_SAVING) * padded_slots(padded):
            return [_packed_batch(ids, lengths, groups, packed, pad_id)
                    for groups in packed.batches]
    return [_padded_batch(ids, picked, length, rows, pad_id) for picked, length, rows in padded]


def _padded_batch(ids, picked: np.ndarray, length: int, rows: int, pad_id: int) -> Batch:
    indices = np.full(rows, -1, np.int64)
    indices[: len(picked)] = picked
    return Batch(indices, pad_batch([ids[i] for i in picked], pad_id, length, rows=rows))


def _packed_batch(ids, lengths: np.ndarray, groups: list, plan: PackedPlan,
                  pad_id: int) -> Batch:
    shards, width = len(groups), plan.row_length
    k_max = plan.sentences_per_shard
    indices = np.full(shards * k_max, -1, np.int64)
    layouts = []
    for s, rows in enumerate(groups):
        members = [i for row in rows for i in sorted(row)]
        indices[s * k_max: s * k_max + len(members)] = members
        # The shard's sentences in that order, then empty ones up to k_max: every empty packed
        # slot points past them (it gathers padding and forms a group of its own in the
        # attention mask).
        shard_lengths = np.zeros(k_max, np.int64)
        shard_lengths[: len(members)] = lengths[members]
        bounds = np.cumsum([0] + [len(row) for row in rows])
        bins = [list(range(bounds[r], bounds[r + 1])) for r in range(len(rows))]
        layouts.append(pack_layout(shard_lengths, width, width, row_multiple=1,
                                   rows=plan.rows_per_shard, bins=bins))
    pack = np.stack([p for p, _ in layouts])
    unpack = np.concatenate([u for _, u in layouts])
    rows_ids = [ids[i] if i >= 0 else [] for i in indices]
    return Batch(indices, pad_batch(rows_ids, pad_id, width), (pack, unpack))
