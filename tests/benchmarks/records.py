"""Checks shared by the benchmark scripts' tests: a record's ratios follow from its own rates."""
from __future__ import annotations

import statistics

import pytest


def check_ratio(stats: dict, ours: list, theirs: list) -> None:
    """`stats` (common.ratio_stats) is the median/min/max of the rounds' ours[i] / theirs[i]."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    assert len(ratios) == stats["repeats"] > 0
    assert stats["ratio"] == pytest.approx(statistics.median(ratios))
    assert stats["ratio_min"] == pytest.approx(min(ratios))
    assert stats["ratio_max"] == pytest.approx(max(ratios))


def check_rate(per_s: float, rates: list) -> None:
    """A reported rate is the median of its rounds' rates."""
    assert all(r > 0 for r in rates)
    assert per_s == pytest.approx(statistics.median(rates))


def products_flops(arch: dict, tokens: int, length: int, passes: int = 3) -> float:
    """FLOPs of the encoder's matrix products alone: one forward (passes=1), or forward +
    backward (passes=3, the backward twice the forward)."""
    h, inner, layers = arch["hidden_size"], arch["intermediate_size"], arch["num_hidden_layers"]
    per_token = 2 * (4 * h * h + 2 * h * inner)  # q, k, v, attention output; the two FFN dense
    attention = 2 * 2 * length * h  # scores and weighted sum, per token
    return passes * layers * tokens * (per_token + attention)


def parameter_count(arch: dict) -> int:
    """Weights of a BERT encoder (biases and layer norms left out)."""
    h, inner = arch["hidden_size"], arch["intermediate_size"]
    embeddings = (arch["vocab_size"] + arch["max_position_embeddings"]
                  + arch["type_vocab_size"]) * h
    return embeddings + arch["num_hidden_layers"] * (4 * h * h + 2 * h * inner)


def metadata(op_name: str) -> str:
    """An HLO instruction's metadata attribute naming its JAX op."""
    return f'metadata={{op_name="{op_name}"}}'


def dot_and_erf_bodies(scope: str) -> str:
    """Two fusion bodies of XLA:CPU's optimized text (layouts left out): `fused_dot` (a product)
    and `fused_erf` (GELU's erf, under `scope`'s intermediate layer)."""
    return f"""%fused_dot (p0: f32[8,4], p1: f32[4,6]) -> f32[8,6] {{
  %p0 = f32[8,4] parameter(0)
  %p1 = f32[4,6] parameter(1)
  ROOT %dot.1 = f32[8,6] dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%fused_erf (p0: f32[8,6]) -> f32[8,6] {{
  %p0 = f32[8,6] parameter(0)
  ROOT %erf.1 = f32[8,6] erf(%p0), {metadata(scope + "/intermediate/mul")}
}}
"""
