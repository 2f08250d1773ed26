"""encode_layout: the padded and packed batch plans of `jaxsim.encode` (host side only)."""
from __future__ import annotations

import numpy as np
import pytest

from jaxsim.data import encode_layout
from jaxsim.data.tokenize import bucket_length


def _ids(lengths):
    """Token id lists whose ids name their sentence and position (sentence i, token j:
    1000 * (i + 1) + j), so a misplaced token is visible."""
    return [[1000 * (i + 1) + j for j in range(n)] for i, n in enumerate(lengths)]


def _check_packed(batches, ids, shards):
    seen = []
    for batch in batches:
        pack, unpack = batch.packing
        tokens = batch.tokens
        s, rows, width = pack.shape
        assert s == shards and tokens.input_ids.shape == (len(batch.indices), width)
        per_shard = len(batch.indices) // shards
        assert per_shard >= 8 and unpack.shape == tokens.input_ids.shape
        # Few shapes: sentence counts on the bucket grid; rows a power of two or the limit.
        assert per_shard == bucket_length(per_shard, 1 << 30)
        assert rows & (rows - 1) == 0 or rows == 1024 // width
        for row, i in enumerate(batch.indices):
            if i < 0:
                assert tokens.attention_mask[row].sum() == 0
                continue
            seen.append(int(i))
            n = len(ids[i])
            assert tokens.input_ids[row, :n].tolist() == ids[i]
            assert tokens.attention_mask[row].sum() == n
            shard, k = divmod(row, per_shard)
            # Each token's packed slot (local to the shard) points back at that token.
            slots = unpack[row, :n]
            assert (pack[shard].reshape(-1)[slots] == k * width + np.arange(n)).all()
            assert len(set((slots // width).tolist())) == 1  # a sentence stays in one row
        # Every slot of a shard holds one token of its own shard's sentences, or nothing.
        flat = pack.reshape(shards, -1)
        assert ((flat >= 0) & (flat <= per_shard * width)).all()
    return seen


@pytest.mark.parametrize("shards", [1, 4])
def test_mixed_short_sentences_are_packed_each_once(shards):
    # Mostly short sentences and a few long ones, as in STS: padded batches of the longest
    # pad their short rows, packed rows take the short sentences in the long ones' gaps.
    rng = np.random.default_rng(0)
    lengths = rng.permutation(np.concatenate([rng.integers(3, 20, 1900),
                                              rng.integers(30, 40, 100)]))
    ids = _ids(lengths)
    batches = encode_layout.plan_batches(ids, 0, 64, 128, shards, 1024 * shards)
    assert all(b.packing is not None for b in batches)
    seen = _check_packed(batches, ids, shards)
    assert sorted(seen) == list(range(len(ids)))
    width = batches[0].packing[0].shape[-1]
    assert width == bucket_length(int(lengths.max()), 128)
    packed_slots = sum(b.packing[0].size for b in batches)
    padded = encode_layout.padded_plan(lengths, 64, 128, shards, 1024 * shards)
    assert packed_slots <= (1 - encode_layout.PACK_SAVING) * encode_layout.padded_slots(padded)
    empty = len(batches[0].indices) // shards * width  # the slot index of an empty slot
    used_rows = sum(int((b.packing[0] < empty).any(-1).sum()) for b in batches)
    assert used_rows * width < 1.1 * lengths.sum()  # the rows used are almost full


def test_long_texts_of_similar_length_stay_padded():
    lengths = np.random.default_rng(1).integers(64, 124, size=200)
    ids = _ids(lengths)
    batches = encode_layout.plan_batches(ids, 0, 64, 128, 1, 1024)
    assert all(b.packing is None for b in batches)
    seen = [int(i) for b in batches for i in b.indices if i >= 0]
    assert sorted(seen) == list(range(len(ids)))
    for batch in batches:
        real = batch.indices[batch.indices >= 0]
        for row, i in enumerate(real):
            assert batch.tokens.input_ids[row, : lengths[i]].tolist() == ids[i]


def test_pack_false_and_empty_chunks():
    lengths = np.random.default_rng(2).integers(3, 40, size=100)
    ids = _ids(lengths)
    assert all(b.packing is None for b in encode_layout.plan_batches(ids, 0, 64, 128, 1, 1024,
                                                                     pack=False))
    assert encode_layout.plan_batches([], 0, 64, 128) == []


def test_packed_shards_hold_about_even_sentence_counts():
    # Long sentences and many very short ones: first fit puts the short ones in their own
    # rows; dealt over the shards, no shard gets all of them.
    lengths = np.array([60] * 40 + [3] * 400)
    plan = encode_layout.packed_plan(lengths, 64, 128, 4, 4096)
    counts = [sum(len(row) for row in shard) for batch in plan.batches for shard in batch]
    assert max(counts) - min(counts) <= max(counts) // 2
    assert plan.sentences_per_shard >= max(counts)
    assert all(len(shard) <= plan.rows_per_shard for batch in plan.batches for shard in batch)
