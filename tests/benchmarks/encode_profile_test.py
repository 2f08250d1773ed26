"""benchmarks/encode_profile.py: a forward-only program's ops are classified by their scope (never
as the optimizer's), and a short run on the bundled model writes a consistent record (categories
summing to the op time, the pass's FLOPs against the model's product count over the laid-out
token slots, the bound)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.records import dot_and_erf_bodies, metadata, products_flops
from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_profile as sp  # noqa: E402

SCOPE = "jit(encode_batch)/SentenceEncoder/bert/encoder/layer_0"
POOLER = "jit(encode_batch)/SentenceEncoder/pooler/add"
DOT, MUL, STACK = "/dot_general", "/intermediate/mul", "/attention/self/stack"
MINILM = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}


HLO = f"""HloModule jit_encode_batch, entry_computation_layout={{()->f32[]}}

{dot_and_erf_bodies(SCOPE)}
%fused_stack (p0: f32[4,6], p1: f32[4,6]) -> f32[4,12] {{
  %p0 = f32[4,6] parameter(0)
  %p1 = f32[4,6] parameter(1)
  ROOT %concatenate.1 = f32[4,12] concatenate(%p0, %p1), dimensions={{1}}
}}

ENTRY %main (a: f32[8,4], w: f32[4,6]) -> f32[8,6] {{
  %a = f32[8,4] parameter(0)
  %w = f32[4,6] parameter(1)
  %dot_fusion = f32[8,6] fusion(%a, %w), kind=kOutput, calls=%fused_dot, {metadata(SCOPE + DOT)}
  %gelu = f32[8,6] fusion(%dot_fusion), kind=kLoop, calls=%fused_erf, {metadata(SCOPE + MUL)}
  %stack = f32[4,12] fusion(%w, %w), kind=kLoop, calls=%fused_stack, {metadata(SCOPE + STACK)}
  %ln = f32[8,6] multiply(%gelu, %gelu), {metadata(SCOPE + "/output/LayerNorm/mul")}
  %soft = f32[8,6] exponential(%ln), {metadata(SCOPE + "/attention/self/softmax/exp")}
  ROOT %add.2 = f32[8,6] add(%soft, %soft), {metadata(POOLER)}
}}
"""


def test_forward_only_ops_are_classified_by_their_scope():
    times = {n: 1_000_000 for n in ("dot_fusion", "gelu", "stack", "ln", "soft", "add.2")}
    table = sp.breakdown(times, HLO, steps=1, forward_only=True)
    by_name = {r["instruction"]: r["category"] for r in table["top_instructions"]}
    assert by_name == {"dot_fusion": sp.DENSE_FWD, "gelu": sp.GELU, "stack": sp.COPIES,
                       "ln": sp.LAYER_NORM, "soft": sp.SOFTMAX, "add.2": sp.OTHER}
    # Read as a train step, an op outside any 'jvp(' scope is the optimizer's update.
    as_step = sp.breakdown(times, HLO, steps=1)
    assert {r["instruction"]: r["category"] for r in as_step["top_instructions"]}["add.2"] \
        == sp.OPTIMIZER


def test_short_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "encode_profile.py"), "--limit", "40",
         "--batch-size", "16", "--threads", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not the wall time" in proc.stdout
    record = json.loads(out.read_text())
    assert record["sentences"] == 40 and record["model"] == "all-MiniLM-L6-v2"
    rows = {r["category"]: r for r in record["categories"]}
    assert rows and set(rows) <= set(sp.CATEGORIES) - {sp.DENSE_BWD, sp.OPTIMIZER, sp.DROPOUT}
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(record["op_ms"], abs=0.01)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert record["ratio"] == record["dense_share"] == pytest.approx(rows[sp.DENSE_FWD]["share"])
    assert 0 < record["dense_share"] < 1
    assert record["bound"] == pytest.approx(1 / record["dense_share"])
    # The laid-out token slots (padded batches) bound XLA's count from below:
    # it also counts the elementwise work.
    products = sum(shape["batches"] * products_flops(MINILM, _slots(shape), _row(shape), 1)
                   for shape in record["shapes"])
    assert products <= record["flops"] <= 1.3 * products, (record["flops"], products)
    assert record["dense_gflops"] == pytest.approx(
        record["flops"] / rows[sp.DENSE_FWD]["ms"] * 1e3 / 1e9)
    assert record["wall_s"] == pytest.approx(sum(s["wall_s"] for s in record["shapes"]), abs=1e-3)
    top = [r["ms_per_step"] for r in record["top_instructions"]]
    assert top == sorted(top, reverse=True) and "load_average_1min" in record


def _slots(shape: dict) -> int:
    rows, length = shape["tokens"]
    return rows * length


def _row(shape: dict) -> int:
    return shape["tokens"][1]
