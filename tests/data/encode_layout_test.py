"""encode_layout: the length-sorted batch plan of `jaxsim.encode` (host side only)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxsim import sharding
from jaxsim.data import encode_layout
from jaxsim.data.tokenize import bucket_length


def _ids(lengths):
    """Token id lists whose ids name their sentence and position (sentence i, token j:
    1000 * (i + 1) + j), so a misplaced token is visible."""
    return [[1000 * (i + 1) + j for j in range(n)] for i, n in enumerate(lengths)]


@pytest.mark.parametrize("shards, budget", [(1, None), (1, 1024), (4, 4096)])
def test_every_sentence_once_in_length_order_within_budget(shards, budget):
    lengths = np.random.default_rng(0).integers(1, 128, size=500)
    ids = _ids(lengths)
    batches = encode_layout.plan_batches(ids, 0, 64, 128, shards, budget)
    seen, previous = [], 0
    for batch in batches:
        rows, length = batch.tokens.input_ids.shape
        real = batch.indices[batch.indices >= 0]
        assert (batch.indices[: len(real)] >= 0).all()  # padding rows come last
        assert rows == encode_layout.rows_per_batch(length, 64, shards, budget) >= len(real)
        assert rows % shards == 0 and (budget is None or rows * length <= budget)
        assert length == bucket_length(int(lengths[real].max()), 128)
        assert lengths[real].min() >= previous  # sorted: no batch reaches back
        previous = int(lengths[real].max())
        for row, i in enumerate(real):
            assert batch.tokens.input_ids[row, : lengths[i]].tolist() == ids[i]
            assert batch.tokens.attention_mask[row].sum() == lengths[i]
        assert batch.tokens.attention_mask[len(real):].sum() == 0
        seen += real.tolist()
    assert sorted(seen) == list(range(len(ids)))


def test_rows_per_batch_keeps_whole_shards():
    assert encode_layout.rows_per_batch(128, 64, 4, None) == 64  # accelerators: no budget
    assert encode_layout.rows_per_batch(128, 64, 1, 1024) == 8
    assert encode_layout.rows_per_batch(512, 64, 4, 4096) == 8
    assert encode_layout.rows_per_batch(512, 64, 4, 1024) == 4  # never below the shards


def test_token_budget_applies_to_cpu_meshes_only():
    mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert jax.devices()[0].platform == "cpu"
    assert encode_layout.token_budget(mesh, 1) == encode_layout.CPU_TOKENS_PER_BATCH
    assert encode_layout.token_budget(mesh, 4) == 4 * encode_layout.CPU_TOKENS_PER_BATCH

    class _Device:
        platform = "tpu"

    class _Mesh:
        devices = np.array([_Device()])

    assert encode_layout.token_budget(_Mesh(), 4) is None


def test_empty_chunk():
    assert encode_layout.plan_batches([], 0, 64, 128) == []
