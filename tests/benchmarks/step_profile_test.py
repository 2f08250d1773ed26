"""benchmarks/step_profile.py: the HLO classification on a hand-written module, and a tiny real
run end to end (XLA totals against the model's own product count, the category table, the
dense-product ratio)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.records import dot_and_erf_bodies, metadata, products_flops
from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_profile as sp  # noqa: E402

FWD = "jit(train_step)/jvp(SentenceEncoder)/bert/encoder/layer_0"
BWD = "jit(train_step)/transpose(jvp(SentenceEncoder))/bert/encoder/layer_0"


# The shapes of XLA:CPU's optimized text (layouts left out): fusions calling their bodies, the
# threefry hash's rolled loop over uint32 bits, the update in a conditional's branch.
HLO = f"""HloModule jit_train_step, entry_computation_layout={{()->f32[]}}

{dot_and_erf_bodies(FWD)}
%fused_cast (p0: f32[8,6]) -> bf16[8,6] {{
  %p0 = f32[8,6] parameter(0)
  ROOT %convert.1 = bf16[8,6] convert(%p0)
}}

%fused_ln (p0: f32[8,6]) -> f32[8,6] {{
  %p0 = f32[8,6] parameter(0)
  ROOT %multiply.9 = f32[8,6] multiply(%p0, %p0), {metadata(FWD + "/output/LayerNorm/mul")}
}}

%hash_body (t: (s32[], u32[8,6])) -> (s32[], u32[8,6]) {{
  %t = (s32[], u32[8,6]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %bits = u32[8,6] get-tuple-element(%t), index=1
  %rot = u32[8,6] shift-left(%bits, %bits), {metadata(FWD + "/output/while/body/shift_left")}
  ROOT %out = (s32[], u32[8,6]) tuple(%i, %rot)
}}

%hash_cond (t: (s32[], u32[8,6])) -> pred[] {{
  %t = (s32[], u32[8,6]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %lt = pred[] compare(%i, %i), direction=LT, {metadata(FWD + "/output/while/cond/lt")}
}}

%update (p: f32[8,6]) -> f32[8,6] {{
  %p = f32[8,6] parameter(0)
  ROOT %divide.3 = f32[8,6] divide(%p, %p), {metadata("jit(train_step)/cond/branch_1_fun/div")}
}}

ENTRY %main (a: f32[8,4], w: f32[4,6], s: (s32[], u32[8,6])) -> f32[8,6] {{
  %a = f32[8,4] parameter(0)
  %w = f32[4,6] parameter(1)
  %s = (s32[], u32[8,6]) parameter(2)
  %fwd_dot = f32[8,6] fusion(%a, %w), calls=%fused_dot, {metadata(FWD + "/output/dot_general")}
  %bwd_dot = f32[8,6] fusion(%a, %w), calls=%fused_dot, {metadata(BWD + "/output/dot_general")}
  %gelu = f32[8,6] fusion(%fwd_dot), calls=%fused_erf, {metadata(FWD + "/intermediate/mul")}
  %cast = bf16[8,6] fusion(%gelu), calls=%fused_cast, {metadata(FWD + "/output/convert")}
  %ln = f32[8,6] fusion(%gelu), calls=%fused_ln, {metadata(FWD + "/output/add")}
  %while.1 = (s32[], u32[8,6]) while(%s), condition=%hash_cond, body=%hash_body
  %cond.1 = f32[8,6] conditional(%fwd_dot), branch_computations={{%update}}
  ROOT %add.2 = f32[8,6] add(%ln, %bwd_dot), {metadata(FWD + "/pooler/add")}
}}
"""


def test_classifies_a_hand_written_module():
    instructions = sp.parse_hlo(HLO)
    assert instructions["fwd_dot"]["calls"] == ["fused_dot"]
    assert instructions["while.1"]["opcode"] == "while"
    assert instructions["cond.1"]["calls"] == ["update"]
    # One op event per instruction, 1 ms each over one step; control flow is left out.
    names = ("fwd_dot", "bwd_dot", "gelu", "cast", "ln", "rot", "lt", "divide.3", "add.2",
             "while.1", "cond.1")
    times = {n: 1_000_000 for n in names}
    times["fwd_dot"] = 5_000_000
    table = sp.breakdown(times, HLO, steps=1)
    by_name = {r["instruction"]: r["category"] for r in table["top_instructions"]}
    assert by_name == {"fwd_dot": sp.DENSE_FWD, "bwd_dot": sp.DENSE_BWD, "gelu": sp.GELU,
                       "cast": sp.COPIES, "ln": sp.LAYER_NORM, "rot": sp.DROPOUT,
                       "lt": sp.DROPOUT, "divide.3": sp.OPTIMIZER, "add.2": sp.OTHER}
    assert table["op_ms_per_step"] == pytest.approx(13.0)
    assert table["control_flow_span_ms_per_step"] == pytest.approx(2.0)
    assert table["dense_share"] == pytest.approx(6.0 / 13.0)
    assert table["top_instructions"][0]["instruction"] == "fwd_dot"


def test_tiny_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--tiny", "--batch", "8",
         "--max-len", "32", "--steps", "2", "--threads", "1", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not the wall time" in proc.stdout
    record = json.loads(out.read_text())
    arch = sp.TINY
    assert record["model"] == "tiny"
    products = products_flops(arch, tokens=8 * 2 * 32, length=32)
    # XLA also counts the elementwise work and AdamW over all 2M parameters.
    assert products <= record["flops"] <= 2 * products, (record["flops"], products)
    assert record["bytes_accessed"] > 0 and record["temp_bytes"] > 0
    assert record["wall_ms_per_step"] > 0
    table = record["breakdown"]
    rows = {r["category"]: r for r in table["categories"]}
    assert rows and set(rows) <= set(sp.CATEGORIES)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0)
    assert sum(r["ms_per_step"] for r in rows.values()) == pytest.approx(
        table["op_ms_per_step"], abs=0.01)
    assert rows[sp.DENSE_FWD]["ms_per_step"] > 0 and rows[sp.DENSE_BWD]["ms_per_step"] > 0
    assert rows[sp.OPTIMIZER]["ms_per_step"] > 0 and rows[sp.DROPOUT]["ms_per_step"] > 0
    assert 0 < record["ratio"] <= 1
    assert record["ratio"] == pytest.approx(
        rows[sp.DENSE_FWD]["share"] + rows[sp.DENSE_BWD]["share"])
    top = [r["ms_per_step"] for r in table["top_instructions"]]
    assert len(top) == 10 and top == sorted(top, reverse=True)
    assert "load_average_1min" in record  # written through common.write_json


def test_report_without_op_events_keeps_the_totals(capsys):
    record = {"flops": 2.5e9, "bytes_accessed": 2.0 ** 30, "temp_bytes": 2.0 ** 29,
              "wall_ms_per_step": 12.0, "steps": 2, "compile_s": 1.0, "breakdown": None,
              "breakdown_unavailable": "the trace has no per-op events on this backend"}
    sp.report(record)
    out = capsys.readouterr().out
    assert "2.50 GFLOP, 1.00 GiB accessed, temp buffers 0.500 GiB" in out
    assert "op breakdown unavailable: the trace has no per-op events" in out
    assert "Traceback" not in out
