"""The plan: the real train step compiled for TPU topologies on this CPU (libtpu, no TPU), and
what XLA says of it, read back correctly.

The compiles are of the tiny config (2 layers x 32 hidden) on v5e:2x2: seconds each. What a
test asserts is structural (which collectives, over which mesh axes and networks; memory
divided by a sharded axis; the roofline's arithmetic), never a time.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jaxsim import sharding as sharding_lib
from jaxsim.cli import plan as plan_cli
from jaxsim.cli.plan import format_plan, run_plan
from jaxsim.errors import ConfigError
from jaxsim.models import dropout
from jaxsim.models.encoder import param_shapes
from jaxsim.plan import breakdown, hlo, planner
from jaxsim.plan import figures as fig
from jaxsim.plan.chips import CHIPS, TopologyError, parse_topology
from jaxsim.plan.planner import make_plan
from jaxsim.sharding import MeshError, ShardingError
from jaxsim.storage.store import StorageError
from jaxsim.train import build
from jaxsim.train.config import TrainConfig
from jaxsim.train.config_files import apply_overrides, load_config_file
from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny_unsup_simcse.py"
V5E_2X2 = parse_topology("v5e:2x2")
JSON_KEYS = ("fits", "hbm_gib", "collectives", "flops_per_chip", "bytes_per_chip",
             "step_s_estimate", "mfu_ceiling")


def tiny(**changes) -> TrainConfig:
    fields = apply_overrides(load_config_file(str(TINY)), [])
    fields.update(train_file="(none)", **changes)
    return TrainConfig.from_dict(fields, source=str(TINY))


def plan(cfg: TrainConfig, num_slices: int = 1):
    return make_plan(cfg, V5E_2X2, num_slices, encode=False, search=False, say=lambda m: None)


def param_bytes(cfg: TrainConfig) -> int:
    encoder = build.make_encoder(cfg, build.architecture(cfg))
    return sum(math.prod(x.shape) * x.dtype.itemsize
               for x in jax.tree.leaves(param_shapes(encoder)))


@pytest.fixture(scope="module")
def data_parallel():
    return plan(tiny())


# ---- topologies -------------------------------------------------------------------------------

@pytest.mark.parametrize("text,name,chips", [
    ("v5e:4x4", "v5e:4x4", 16), ("V5litepod-16", "v5e:4x4", 16), ("v5e-256", "v5e:16x16", 256),
    ("v4-32", "v4:2x2x4", 16), ("v5p:4x4x4", "v5p:4x4x4", 64), ("v6e-64", "v6e:8x8", 64)])
def test_topology_spellings(text, name, chips):
    topology = parse_topology(text)
    assert (topology.name, topology.chips) == (name, chips)
    assert topology.chip is CHIPS[name.split(":")[0]]


@pytest.mark.parametrize("text", ["v9:2x2", "v5e:2x2x2", "v4:4x4", "v5e-12", "v4-3", "pod"])
def test_unknown_topologies_are_one_line_before_any_compile(text):
    with pytest.raises(TopologyError) as e:
        parse_topology(text)
    assert str(e.value).startswith(f"--topology {text}") and "\n" not in str(e.value)


# ---- reading the compiled HLO -----------------------------------------------------------------

@pytest.mark.parametrize("attributes,groups", [
    ("replica_groups={{0,1},{2,3}}, dimensions={0}", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[4], to_apply=%add", [[0, 1], [2, 3]]),
    ("replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add", [[0, 2], [1, 3]]),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}, to_apply=%add", [[0, 2], [1, 3]]),
    ("replica_groups={}, to_apply=%add", [[0, 1, 2, 3]]),
    ("source_target_pairs={{0,1},{1,0}}", [[0, 1], [1, 0]]),
])
def test_replica_groups_in_each_spelling(attributes, groups):
    assert hlo.replica_groups(attributes, 4) == groups


SYNTHETIC = """HloModule m

%fused_gather (p: f32[4,8]) -> f32[8,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %all-gather.9 = f32[8,8]{1,0:T(8,128)S(1)} all-gather(%p), channel_id=7, replica_groups={{0,2},{1,3}}, dimensions={0}, metadata={op_name="jit(f)/gather_z"}
}

%updates (x: f32[4,8]) -> f32[8,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %all-gather.20 = f32[8,8]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, frontend_attributes={async_collective_name="all-gather-start.1"}, metadata={op_name="jit(f)/shard_map/all_gather"}
  %all-gather.21 = f32[8,8]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, frontend_attributes={async_collective_name="all-gather-start.2"}, metadata={op_name="jit(f)/shard_map/all_gather"}
  %all-gather.22 = bf16[8,4]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, metadata={op_name="jit(f)/shard_map/all_gather"}
  ROOT %all-gather.23 = bf16[8,4]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, metadata={op_name="jit(f)/shard_map/all_gather"}
}

ENTRY %main (z: f32[4,8], g: f32[16], h: bf16[4,8]) -> f32[16] {
  %all-gather-start.1 = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%z), channel_id=7, replica_groups={{0,2},{1,3}}, dimensions={0}, metadata={op_name="jit(f)/gather_z"}
  %fusion.1 = f32[8,8]{1,0} fusion(%z), kind=kCustom, calls=%fused_gather
  %all-reduce.3 = f32[16]{0} all-reduce(%g), channel_id=9, replica_groups=[1,4]<=[4], to_apply=%add
  %reduce-scatter.4 = bf16[2,8]{1,0} reduce-scatter(%h), channel_id=11, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  %collective-permute-start.5 = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%g), channel_id=12, source_target_pairs={{0,1},{1,0}}
  %call.6 = f32[8,8]{1,0} call(%z), to_apply=%updates
  ROOT %add.5 = f32[16]{0} add(%all-reduce.3, %all-reduce.3)
}
"""  # noqa: E501


def test_collectives_are_one_per_channel_with_mesh_axes_and_network():
    """The copies an async collective leaves in several computations count once; groups give
    the mesh axes (device ids row-major over the mesh) and whether a group spans slices."""
    found = [c for c in hlo.collectives(SYNTHETIC, (2, 2), ("data", "fsdp"),
                                        slice_of=[0, 0, 1, 1]) if "shard_map" not in c.op_name]
    assert [(c.kind, c.axes, c.dcn, c.group_size, c.bytes) for c in found] == [
        ("all-gather", ("data",), True, 2, 8 * 8 * 4),  # the gathered result, not the operand
        ("all-reduce", ("data", "fsdp"), True, 4, 16 * 4),
        ("reduce-scatter", ("fsdp",), False, 2, 2 * 8 * 2),
        ("collective-permute", ("fsdp",), False, 2, 16 * 4)]  # the start's result, once
    assert found[0].op_name == "jit(f)/gather_z"
    one_slice = hlo.collectives(SYNTHETIC, (2, 2), ("data", "fsdp"), slice_of=[0, 0, 0, 0])
    assert not any(c.dcn for c in one_slice)


def test_collectives_sharing_a_channel_are_told_apart():
    """`shard_map` gives every collective channel 1: gathers of other arrays, or of the same
    shape in one computation, are each a collective (their copies in other computations
    are not)."""
    found = hlo.collectives(SYNTHETIC, (2, 2), ("data", "fsdp"), slice_of=[0, 0, 1, 1])
    updates = [c for c in found if "shard_map" in c.op_name]
    assert [(c.kind, c.bytes) for c in updates] == [("all-gather", 8 * 8 * 4)] * 2 + [
        ("all-gather", 8 * 4 * 2)] * 2


def test_a_collective_copied_into_a_loop_runs_as_often_as_its_fewest_copies():
    found = hlo.collectives(SYNTHETIC, (2, 2), ("data", "fsdp"), slice_of=[0, 0, 1, 1],
                            runs={"main": 1, "fused_gather": 5})
    assert found[0].op_name == "jit(f)/gather_z" and found[0].runs == 1


_SHARED_LOOP = """HloModule shared_loop

%cond (p: (s32[], f32[64,64])) -> pred[] {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[64,64] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[64,64]) tuple(%j, %y)
}

%twice (x: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64] parameter(0)
  %zero = s32[] constant(0)
  %s = (s32[], f32[64,64]) tuple(%zero, %x)
  %w = (s32[], f32[64,64]) while(%s), condition=%cond, body=%body
  ROOT %r = f32[64,64] get-tuple-element(%w), index=1
}

ENTRY %main (x: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64] parameter(0)
  %a = f32[64,64] call(%x), to_apply=%twice
  ROOT %b = f32[64,64] call(%a), to_apply=%twice
}
"""


def test_a_loop_in_a_computation_called_twice_costs_each_run_once():
    """XLA's totals count the loop body once a call site (2 here); the 10 runs add 8 more."""
    runs, found, parent = fig.loops.loops(_SHARED_LOOP)
    assert [(x.runs, x.paths) for x in found] == [(10, 2)]
    once = fig.loops._cost(_SHARED_LOOP, jax.devices("cpu")[0].client)[0]
    scale = fig.loops.loop_scale(_SHARED_LOOP, found, parent)
    assert once == pytest.approx(2 * 2 * 64 ** 3, rel=0.01)
    assert once * scale.flops == pytest.approx(10 * 2 * 64 ** 3, rel=0.01)


# The same shard_map psum in two loops (7 and 3 trips): channel 1 both, no async chain. An
# all-gather whose async chain starts in the entry and continues in the first loop's body.
_TWO_LOOPS = """HloModule two_loops

%cond7 (p: (s32[], f32[2,128])) -> pred[] {
  %p = (s32[], f32[2,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%cond3 (p: (s32[], f32[2,128])) -> pred[] {
  %p = (s32[], f32[2,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%gather_more (p: f32[4,8]) -> f32[8,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %all-gather.5 = f32[8,8]{1,0:S(1)} all-gather(%p), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}, metadata={op_name="jit(f)/shard_map/all_gather"}
}

%body7 (p: (s32[], f32[2,128])) -> (s32[], f32[2,128]) {
  %p = (s32[], f32[2,128]) parameter(0)
  %x = f32[2,128]{1,0} get-tuple-element(%p), index=1
  %psum.15 = f32[2,128]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(f)/shard_map/while/body/psum"}
  %more = f32[8,8]{1,0} fusion(%x), kind=kCustom, calls=%gather_more
  ROOT %t = (s32[], f32[2,128]) tuple(%p)
}

%body3 (p: (s32[], f32[2,128])) -> (s32[], f32[2,128]) {
  %p = (s32[], f32[2,128]) parameter(0)
  %x = f32[2,128]{1,0} get-tuple-element(%p), index=1
  %psum.16 = f32[2,128]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(f)/shard_map/while/body/psum"}
  ROOT %t = (s32[], f32[2,128]) tuple(%p)
}

ENTRY %main (s: (s32[], f32[2,128]), z: f32[4,8]) -> (s32[], f32[2,128]) {
  %s = (s32[], f32[2,128]) parameter(0)
  %z = f32[4,8]{1,0} parameter(1)
  %all-gather.4 = f32[8,8]{1,0} all-gather(%z), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, frontend_attributes={chain_id="0"}, metadata={op_name="jit(f)/shard_map/all_gather"}
  %a = (s32[], f32[2,128]) while(%s), condition=%cond7, body=%body7
  ROOT %b = (s32[], f32[2,128]) while(%a), condition=%cond3, body=%body3
}
"""  # noqa: E501


def test_the_same_psum_in_two_loops_is_two_collectives():
    runs, _, _ = fig.loops.loops(_TWO_LOOPS)
    found = hlo.collectives(_TWO_LOOPS, (4,), ("data",), slice_of=[0] * 4, runs=runs)
    assert sorted((c.kind, c.runs) for c in found) == [
        ("all-gather", 1), ("all-reduce", 3), ("all-reduce", 7)]


@pytest.mark.parametrize("shape,expected", [
    ("f32[2,3]{1,0:T(8,128)}", 24), ("(bf16[4], f32[2])", 16), ("s4[8]", 4),
    ("f8e4m3fnuz[10]", 10), ("c64[2]", 16), ("pred[]", 1), ("token[]", 0)])
def test_shape_bytes(shape, expected):
    assert hlo.shape_bytes(shape) == expected


def test_cross_slice_transfers_are_dcn_collectives():
    """Compiled for several slices, the cross-slice half of a collective is a pair of host
    transfers of the multislice runtime: one DCN collective per rendezvous."""
    line = ('  %send.{i} = (f32[4,8]{{1,0}}, u32[], token[]) send(%x, %after-all), channel_id={i}, '
            'is_host_transfer=true, frontend_attributes={{_xla_host_transfer_handler_name='
            '"xla_megascale_runtime",_xla_host_transfer_rendezvous="{name}",'
            '_xla_megascale_target="{{1,2}}x{{0:3}}",_xla_megascale_transfer_type="{kind}"}}')
    text = "\n".join([line.format(i=1, name="all-reduce.3_0", kind="ALL_REDUCE"),
                      line.format(i=2, name="all-reduce.3_0", kind="ALL_REDUCE"),
                      line.format(i=3, name="all-gather.5_0", kind="ALL_GATHER")])
    found = hlo.collectives(text, (4, 1), ("data", "fsdp"), slice_of=[0, 0, 1, 1])
    assert [(c.kind, c.axes, c.dcn, c.group_size, c.bytes) for c in found] == [
        ("all-reduce", ("data",), True, 2, 128), ("all-gather", ("data",), True, 2, 256)]


def test_link_traffic_and_roofline_arithmetic():
    ring = hlo.Collective("all-reduce", 1000, 4, ("data",), False)
    assert ring.traffic_bytes == pytest.approx(2 * 0.75 * 1000)
    assert hlo.Collective("all-gather", 1000, 4, ("data",), False).traffic_bytes == 750
    assert hlo.Collective("reduce-scatter", 250, 4, ("data",), False).traffic_bytes == 750
    assert hlo.Collective("all-reduce", 1000, 1, (), False).traffic_bytes == 0
    chip = CHIPS["v5e"]
    figures = fig.ProgramFigures("p", flops=2 * chip.peak_flops,
                                 bytes_accessed=chip.hbm_bytes_per_s,
                                 argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0,
                                 code_bytes=0, collectives=(ring,), compile_s=0.0)
    roof = fig.roofline(figures, chip)
    assert (roof.compute_s, roof.memory_s) == (2.0, 1.0)
    assert roof.step_s == pytest.approx(2.0 + 1500 / chip.ici_bytes_per_s)
    assert roof.mfu_ceiling() == pytest.approx(2.0 / roof.step_s) and roof.bound == "compute"


BREAKDOWN_HLO = """
%fused_add (a: f32[8,4], b: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[8,4]{1,0} parameter(1)
  ROOT %inner = f32[8,4]{1,0} add(%a, %b), metadata={op_name="jit(f)/inside_fusion"}
}

%add_scalars (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y), metadata={op_name="jit(f)/combiner"}
}

%branch_update (s: (f32[8,4])) -> (f32[8,4]) {
  %s = (f32[8,4]{1,0}) parameter(0)
  %w = f32[8,4]{1,0} get-tuple-element(%s), index=0
  %upd = f32[8,4]{1,0} multiply(%w, %w), metadata={op_name="jit(f)/cond/branch_1_fun/mul"}, backend_config={"estimated_cycles":"50"}
  ROOT %t = (f32[8,4]{1,0}) tuple(%upd)
}

ENTRY %main (p0: f32[8,4], p1: f32[8,4], ok: pred[]) -> f32[] {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = f32[8,4]{1,0} parameter(1)
  %ok = pred[] parameter(2)
  %f0 = f32[8,4]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/bert/encoder/layer_0/add"}, backend_config={"estimated_cycles":"100"}
  %f1 = f32[8,4]{1,0} fusion(%f0, %p1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/bert/encoder/layer_11/add"}, backend_config={"estimated_cycles":"120"}
  %c = bf16[8,4]{1,0} convert(%f1), metadata={op_name="jit(f)/convert_element_type"}
  %st = (f32[8,4]{1,0}) tuple(%f1)
  %cond = (f32[8,4]{1,0}) conditional(%ok, %st, %st), true_computation=%branch_update, false_computation=%branch_update
  ROOT %r = f32[] reduce(%f1, %p0), dimensions={0,1}, to_apply=%add_scalars, metadata={op_name="jit(f)/reduce_sum"}, backend_config={"estimated_cycles":"30"}
}
"""  # noqa: E501


def test_breakdown_groups_top_level_instructions_by_operation_with_layers_merged():
    """Fusion insides and reduction combiners are not instructions of their own, a conditional
    is not traffic (its branch's instructions are), layer indices merge into one row."""
    costs = {c.op: c for c in breakdown.op_costs(BREAKDOWN_HLO)}
    tile = 8 * 4 * 4  # one f32[8,4]
    assert set(costs) == {"bert/encoder/layer_N/add", "cond/branch_1_fun/mul",
                          "convert_element_type", "reduce_sum"}
    layers = costs["bert/encoder/layer_N/add"]
    assert (layers.instructions, layers.cycles, layers.bytes) == (2, 220, 2 * 3 * tile)
    assert (costs["cond/branch_1_fun/mul"].cycles, costs["cond/branch_1_fun/mul"].bytes) == (
        50, 3 * tile)  # each operand counted: w * w reads w twice
    assert costs["convert_element_type"].bytes == tile + tile // 2  # f32 in, bf16 out
    assert costs["reduce_sum"].bytes == 2 * tile + 4
    assert [c.op for c in breakdown.op_costs(BREAKDOWN_HLO)][:2] == [
        "bert/encoder/layer_N/add", "cond/branch_1_fun/mul"]  # most cycles first
    summary = breakdown.summary(breakdown.op_costs(BREAKDOWN_HLO), top=2)
    assert summary["estimated_cycles"] == 300 and len(summary["operations"]) == 2
    assert summary["operations"][0]["cycles_share"] == pytest.approx(220 / 300, abs=1e-4)


def test_the_call_graph_names_each_kind_of_call():
    """One reader of HLO call edges serves the loop counts, the collectives' runners and the
    breakdown: a conditional's branch once however often it is listed, a reduction's
    combiner apart from a `call`'s body, a loop with its condition."""
    text = BREAKDOWN_HLO.replace(
        "  ROOT %r = f32[] reduce(",
        "  %called = (f32[8,4]{1,0}) call(%st), to_apply=%branch_update\n"
        "  ROOT %r = f32[] reduce(")
    graph = hlo.call_graph(hlo.computations(text))
    assert graph["main"] == [
        hlo.Call("inner", "fused_add"), hlo.Call("inner", "fused_add"),
        hlo.Call("branch", "branch_update"), hlo.Call("call", "branch_update"),
        hlo.Call("combiner", "add_scalars")]
    assert graph["fused_add"] == [] and graph["branch_update"] == []
    loops_graph = hlo.call_graph(hlo.computations(_TWO_LOOPS))
    assert loops_graph["main"] == [hlo.Call("loop", "body7", "cond7"),
                                   hlo.Call("loop", "body3", "cond3")]
    assert loops_graph["body7"] == [hlo.Call("combiner", "add"),
                                    hlo.Call("inner", "gather_more")]


def test_breakdown_counts_a_called_computations_instructions():
    """A `call`'s body (`to_apply`) is a computation of its own, not a fusion's inside or a
    reduction's combiner: its instructions are charged."""
    text = BREAKDOWN_HLO.replace(
        "  ROOT %r = f32[] reduce(",
        "  %called = (f32[8,4]{1,0}) call(%st), to_apply=%branch_update\n"
        "  ROOT %r = f32[] reduce(")
    costs = {c.op: c for c in breakdown.op_costs(text)}
    # Run from the conditional and from the call: twice.
    assert (costs["cond/branch_1_fun/mul"].instructions, costs["cond/branch_1_fun/mul"].cycles) \
        == (1, 100)
    assert "combiner" not in costs and "inside_fusion" not in costs


# ---- the real step, compiled for v5e:2x2 ------------------------------------------------------

def test_data_parallel_step_gathers_once_each_way_and_reduces_every_gradient(data_parallel):
    """Global in-batch negatives need the vectors gathered once forward and once backward (the
    transpose of the gather can be a reduce); the gradient all-reduce carries every parameter."""
    cfg = tiny()
    step = data_parallel.train.program
    counts = step.collective_counts()
    assert 1 <= counts["all-gather"] <= 3
    assert counts["reduce-scatter"] == counts["all-to-all"] == 0
    assert all(c.axes == ("data",) and not c.dcn for c in step.collectives)
    reduced = sum(c.bytes for c in step.collectives if c.kind == "all-reduce")
    assert reduced >= param_bytes(cfg)
    assert data_parallel.train.parameters == param_bytes(cfg)  # replicated: all of them
    assert data_parallel.train.optimizer_state >= 2 * param_bytes(cfg)  # Adam's two moments


def test_plan_record_adds_up(data_parallel):
    r = data_parallel.to_json()
    assert all(k in r for k in JSON_KEYS)
    assert set(r["collectives"]) == set(hlo.KINDS)
    h = r["hbm_gib"]
    assert r["fits"] and h["capacity"] == 16.0
    parts = (h["parameters"] + h["optimizer_state"] + h["batch"] + h["other_arguments"]
             + h["temporaries"] + h["outputs_not_aliased"] + h["program"])
    assert parts == pytest.approx(h["total"], abs=0.005)
    assert r["flops_per_chip"] == data_parallel.train.program.flops > 0
    # The cost model's breakdown of the same step: every layer's rows merged, most time first.
    ops = r["breakdown"]["operations"]
    assert r["breakdown"]["estimated_cycles"] > 0 and ops
    assert [o["cycles"] for o in ops] == sorted((o["cycles"] for o in ops), reverse=True)
    assert any("layer_N" in o["op"] for o in ops)
    assert not any("layer_0" in o["op"] or "layer_1" in o["op"] for o in ops)
    step = max(r["compute_s"], r["hbm_s"]) + r["ici_s"] + r["dcn_s"]
    assert r["step_s_estimate"] == pytest.approx(step, rel=1e-3)
    assert r["mfu_ceiling"] == pytest.approx(r["compute_s"] / step, abs=1e-4)


def test_model_flops_are_bert_bases_published_parameters_at_six_a_token():
    """BERT-base (known by name, no weights): 109,482,240 parameters, of which 85,645,056
    outside the embeddings: 6 FLOPs each per token, plus 12 x layers x length x hidden."""
    fields = apply_overrides(load_config_file(str(REPO / "configs" /
                                                  "unsup_simcse_bert_base.py")), [])
    cfg = TrainConfig.from_dict({**fields, "train_file": "(none)"})
    config = build.architecture(cfg)
    encoder = build.make_encoder(cfg, config)
    assert param_bytes(cfg) == 109_482_240 * 4
    per_token = 6 * 85_645_056 + 12 * 12 * 32 * 768
    assert planner.model_flops(encoder, config, sequences=1024, length=32) == 1024 * 32 * per_token


def test_model_flops_count_the_model_not_the_program(data_parallel):
    """Recomputation adds to XLA's FLOPs, not to the model's: the model-FLOPs MFU does not
    rise with remat."""
    r = data_parallel.to_json()
    remat = plan(tiny(remat="full")).to_json()
    assert remat["model_flops_per_chip"] == r["model_flops_per_chip"] > 0
    assert remat["flops_per_chip"] > r["flops_per_chip"]  # the recomputed forward
    assert remat["mfu_ceiling_model_flops"] < remat["mfu_ceiling"]
    # The plan says what recomputation can reach: the total less the temporaries.
    h = remat["hbm_gib"]
    kept = f"({h['total'] - h['temporaries']:.3f} GiB) stay"
    assert kept in format_plan(remat) and kept not in format_plan(r)


def test_fsdp_divides_parameters_and_optimizer_state_by_its_size(data_parallel):
    sharded = plan(tiny(mesh_data=1, mesh_fsdp=4))
    whole = data_parallel.train
    assert sharded.train.mesh_shape == {"data": 1, "fsdp": 4, "tensor": 1}
    assert sharded.train.parameters <= 1.02 * whole.parameters / 4
    assert sharded.train.optimizer_state <= 1.02 * whole.optimizer_state / 4
    assert any(c.kind == "all-gather" and c.axes == ("fsdp",)
               for c in sharded.train.program.collectives)  # parameters gathered to use them


def test_shard_optimizer_state_splits_adams_moments_over_the_data_axis(data_parallel):
    """ZeRO-1 compiled for v5e:2x2 (data=4): each chip holds 1/4 of the moments of every
    parameter `sharding.update_specs` splits and the whole of the others; the parameters stay
    whole, gathered back after the update."""
    split = plan(tiny(shard_optimizer_state=True))
    whole = data_parallel.train
    shapes = jax.tree.leaves(param_shapes(build.make_encoder(whole.cfg,
                                                             build.architecture(whole.cfg))))
    mesh = AbstractMesh((4, 1, 1), sharding_lib.MESH_AXES)
    params = {str(i): x for i, x in enumerate(shapes)}
    specs = sharding_lib.update_specs({k: P() for k in params}, params, mesh)
    moments = sum(2 * 4 * math.prod(x.shape) // (4 if "data" in specs[k] else 1)
                  for k, x in params.items())
    assert any("data" in s for s in specs.values())
    assert split.train.parameters == whole.parameters
    assert moments <= split.train.optimizer_state <= moments + 64  # + Adam's step counts
    # (the tiny model's 30522-row vocabulary, most of it, stays whole)
    assert split.train.optimizer_state < whole.optimizer_state
    # Every split parameter's updated slices gathered back whole (float32), each its own
    # collective though `shard_map` gives them all one channel.
    gathered = [c for c in split.train.program.collectives
                if c.kind == "all-gather" and "shard_map" in c.op_name]
    assert all(c.axes == ("data",) for c in gathered)
    assert sum(c.bytes for c in gathered) == sum(
        4 * math.prod(x.shape) for k, x in params.items() if "data" in specs[k])
    assert split.to_json()["config"]["shard_optimizer_state"] is True


def test_fsdp_keeps_each_devices_rows():
    """Under fsdp each device holds its own rows' activations, as in data parallelism: the
    layers' inputs and outputs stay split by rows. (Left to itself the partitioner contracted
    over the split 'embed' dimension here: 6.4x the temporaries, every device holding the
    whole batch's activations, all-reduced.)"""
    shape = dict(model_overrides=dict(hidden_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=512),
                 batch_size=256)
    whole = plan(tiny(**shape)).train.program
    sharded = plan(tiny(mesh_data=1, mesh_fsdp=4, **shape)).train.program
    assert sharded.temp_bytes <= 1.25 * whole.temp_bytes
    assert sharded.bytes_accessed <= 1.5 * whole.bytes_accessed


def test_the_plain_forms_move_fewer_bytes_on_tpu():
    """Why a TPU runs the layers' plain forms (`jaxsim.models.kernels`): compiled for v5e, the
    same bf16 step accesses fewer bytes with them than with the CPU forms (float32 product
    results, head-major attention), and the plan compiles 'auto' as those plain forms."""
    shape = dict(model_overrides=dict(hidden_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, intermediate_size=1024),
                 batch_size=128, max_len=32, dtype="bfloat16", fast_compile=False)
    cpu = plan(tiny(kernels="cpu", **shape)).train
    auto = plan(tiny(**shape)).train
    assert auto.cfg.kernels == "xla"
    assert auto.program.bytes_accessed < 0.95 * cpu.program.bytes_accessed
    # The same products; XLA also counts the elementwise work, done in bf16 by the plain forms.
    assert auto.program.flops == pytest.approx(cpu.program.flops, rel=0.1)


def test_tensor_parallel_plan_names_an_indivisible_parameter_or_replicates_it(data_parallel):
    """The vocabulary (30522) does not divide over 4 devices: strict rules name the parameter
    before any compile; replicate_indivisible keeps it whole and shards the rest."""
    with pytest.raises(ShardingError, match="word_embeddings"):
        plan(tiny(mesh_data=1, mesh_tensor=4))
    relaxed = plan(tiny(mesh_data=1, mesh_tensor=4, replicate_indivisible=True))
    assert relaxed.train.parameters < data_parallel.train.parameters
    kinds = {c.kind for c in relaxed.train.program.collectives if c.axes == ("tensor",)}
    assert "all-reduce" in kinds  # row-parallel products sum their partial results


def test_two_slices_reduce_gradients_over_the_data_center_network():
    two = plan(tiny(batch_size=32), num_slices=2)
    assert two.devices == 8 and two.train.mesh_shape["data"] == 8
    dcn = [c for c in two.train.program.collectives if c.dcn]
    assert dcn and all(c.axes == ("data",) and c.group_size == 2 for c in dcn)
    assert any(c.kind == "all-reduce" for c in dcn)
    assert two.train.roofline.dcn_s > 0 and two.to_json()["dcn_s"] > 0


def test_a_mesh_the_topology_cannot_hold_is_one_line_before_any_compile():
    with pytest.raises(MeshError) as e:
        plan(tiny(mesh_data=3))
    assert "\n" not in str(e.value)


def test_a_batch_with_fewer_rows_than_chips_is_refused_with_a_mesh_that_takes_it():
    """Batch 2 on 4 chips: one line before any compile, naming the mesh that splits the batch
    2 ways and the model 2 ways; that mesh passes the same checks."""
    with pytest.raises(ConfigError) as e:
        plan(tiny(batch_size=2))
    message = str(e.value)
    assert "\n" not in message and "cannot be split over 4 batch shards" in message
    assert message.endswith("--config.mesh_data=2 --config.mesh_tensor=2")
    devices = fig.compile_only_devices(V5E_2X2)
    mesh = planner.check_plannable(tiny(batch_size=2, mesh_data=2, mesh_tensor=2), devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2}


def test_dropout_on_tpu_moves_its_input_and_output_once():
    """The TPU form of the dropout bits (each element hashes its own counter) compiles to about
    one read and one write; the CPU form's broadcast-and-reshape is a relayout on TPU."""
    device = fig.compile_only_devices(V5E_2X2)[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((512, 3072), jnp.bfloat16, sharding=sharding)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding)
    moved = 2 * 512 * 3072 * 2

    def with_bits(form):
        def drop(x, key):
            keep = form(key, x.shape, 4) < np.uint32(int(0.9 * 2 ** 16))
            return jnp.where(keep, x / 0.9, 0).astype(x.dtype)
        return fig.compile_program("dropout", jax.jit(drop), (x, key), mesh, lambda m: None)

    tpu = with_bits(dropout.word_bits_elementwise).bytes_accessed
    cpu = with_bits(dropout.word_bits_broadcast).bytes_accessed
    chosen = fig.compile_program("dropout", jax.jit(lambda x, k: dropout.dropout(x, 0.1, k)),
                                 (x, key), mesh, lambda m: None).bytes_accessed
    assert tpu <= 1.2 * moved < cpu
    assert chosen <= 1.2 * moved  # what the model's dropout compiles to on TPU


def test_plan_command_writes_its_json_and_refuses_bad_input_in_one_line(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run(
        [sys.executable, "-m", "jaxsim", "plan", "--config", str(TINY), "--topology", "v5e:2x2",
         "--json", str(out), "--config.batch_size=32"],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    assert all(k in record for k in JSON_KEYS) and record["fits"]
    assert record["max_global_batch"] > 32  # a tiny model: far more than 32 fit
    assert record["encode"]["fits"] and record["encode"]["flops_per_chip"] > 0
    assert "MFU ceiling" in run.stdout and "estimates" in run.stdout
    for bad, says in [(["--topology", "v9:2x2"], "--topology v9:2x2"),
                      (["--topology", "v5e:2x2", "--config.mesh_data=3"], "mesh")]:
        run = subprocess.run([sys.executable, "-m", "jaxsim", "plan", "--config", str(TINY), *bad],
                             cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert run.returncode != 0 and "Traceback" not in run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert says in last, run.stderr[-1000:]


def test_plan_json_never_replaces_its_config(tmp_path):
    config = tmp_path / "c.py"
    config.write_text(TINY.read_text())
    with pytest.raises(StorageError, match=f"^--json {config} would overwrite an input "
                                           f"\\(--config {config}\\)"):
        run_plan(str(config), [], "v5e:2x2", json_path=str(config), overwrite=True)
    assert config.read_text() == TINY.read_text()


def test_an_hlo_dir_that_is_a_file_is_refused_before_any_compile(tmp_path, monkeypatch):
    taken = tmp_path / "hlo"
    taken.write_text("a file")
    monkeypatch.setattr(plan_cli, "make_plan", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(StorageError, match=f"^--hlo-dir {taken} is a file, not a folder"):
        run_plan(str(TINY), [], "v5e:2x2", hlo_dir=str(taken))


def test_train_py_plans_instead_of_training(tmp_path):
    run = subprocess.run([sys.executable, "train.py", "--config", str(TINY), "--plan", "v5e:2x2",
                          "--config.batch_size=32"],
                         cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "on v5e:2x2: 4 devices" in run.stdout and "largest global batch" in run.stdout
    both = subprocess.run([sys.executable, "train.py", "--config", str(TINY), "--plan", "v5e:2x2",
                           "--workdir", str(tmp_path / "w")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert both.returncode == 1 and both.stderr.startswith("error: --plan trains nothing")
    assert not (tmp_path / "w").exists()


def test_one_compile_and_two_slices_from_the_command_lines(tmp_path):
    out = tmp_path / "plan.json"
    run = subprocess.run(
        [sys.executable, "-m", "jaxsim", "plan", "--config", str(TINY), "--topology", "v5e:2x2",
         "--no-encode", "--no-search", "--json", str(out), "--config.batch_size=32",
         "--config.shard_optimizer_state=True"],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    assert "encode" not in record and record["max_global_batch"] is None
    assert record["config"]["shard_optimizer_state"] is True
    assert run.stderr.count("compiling the") == 1
    sliced = subprocess.run([sys.executable, "train.py", "--config", str(TINY), "--plan",
                             "v5e:2x2", "--num-slices", "2", "--config.batch_size=32"],
                            cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert sliced.returncode == 0, sliced.stderr[-2000:]
    assert "v5e:2x2 x 2 slices: 8 devices" in sliced.stdout
    assert " DCN " in sliced.stdout  # the gradient reduction crosses the slices


def test_a_step_the_compiler_refuses_for_want_of_hbm_is_planned_as_not_fitting():
    """XLA:TPU refuses a program whose temporaries exceed the chip; the plan reports what its
    refusal says it needs (no cost figures), instead of failing."""
    big = plan(tiny(batch_size=65536, max_len=64, model_overrides=dict(
        hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)))
    record = big.to_json()
    assert not big.fits and record["compiled"] is False
    assert record["hbm_gib"]["temporaries"] > 2 * record["hbm_gib"]["capacity"]
    assert record["mfu_ceiling"] is None and record["flops_per_chip"] is None
    assert "the compiler refused the step" in format_plan(record)


@pytest.mark.parametrize("size,expected", [("18.00G", 18 * 2 ** 30), ("1.50T", 1.5 * 2 ** 40),
                                           ("512.00M", 2 ** 29)])
def test_the_refusals_figure_in_any_unit(size, expected):
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
               f"HLO temporaries ({size}) exceeds available HBM (15.75G).")
    assert fig.refusal_bytes(message) == int(expected)
    assert fig.refusal_bytes("RESOURCE_EXHAUSTED: something else") is None


def test_a_refused_program_counts_its_arguments_once():
    """The refusal's figure already holds the arguments: two 9 GiB arguments need 18 GiB."""
    mesh, sharding = _one_chip()
    x = jax.ShapeDtypeStruct((9 * 2 ** 28,), jnp.float32, sharding=sharding)  # 9 GiB
    program = fig.compile_program("big", jax.jit(lambda x, y: x.sum() + y.sum()), (x, x), mesh,
                                  lambda m: None)
    assert not program.compiled and program.argument_bytes == 18 * 2 ** 30
    assert program.hbm_bytes == pytest.approx(18 * 2 ** 30, rel=0.01)


# ---- loops: XLA's cost analysis counts a loop's body once ---------------------------------------

def _one_chip():
    device = fig.compile_only_devices(V5E_2X2)[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    return mesh, jax.sharding.NamedSharding(mesh, P())


def _layers(x, w, trips, unroll):
    def layer(x, _):
        return jnp.tanh(x @ w), None
    return jax.lax.scan(layer, x, None, length=trips, unroll=unroll)[0]


def test_a_loops_body_counts_as_often_as_it_runs():
    """A scan of 6 products costs what the same 6 products unrolled cost (XLA's raw total
    counts the body once); nested, 3 x 4 runs of the inner body."""
    mesh, sharding = _one_chip()
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=sharding)

    def compile_(f):
        return fig.compile_program("loop", jax.jit(f), (x, w), mesh, lambda m: None)
    product = 2 * 256 * 512 * 512
    rolled = compile_(lambda x, w: _layers(x, w, 6, 1))
    unrolled = compile_(lambda x, w: _layers(x, w, 6, True))
    assert [(x.trips, x.runs) for x in rolled.loops] == [(6, 6)] and unrolled.loops == ()
    assert rolled.xla_flops < 2 * product  # the body once
    assert rolled.flops == pytest.approx(unrolled.flops, rel=0.01)
    assert rolled.flops == pytest.approx(6 * product, rel=0.02)
    # Bytes: the body's share of the raw total, repeated (at most the whole, 6 times).
    assert rolled.xla_bytes_accessed < rolled.bytes_accessed < 6 * rolled.xla_bytes_accessed

    def nested(x, w):
        return jax.lax.scan(lambda x, _: (_layers(x, w, 4, 1), None), x, None, length=3)[0]
    both = compile_(nested)
    assert sorted((x.trips, x.runs) for x in both.loops) == [(3, 3), (4, 12)]
    assert both.flops == pytest.approx(12 * product, rel=0.02)


# One computation holding a 5-trip loop, called from two places of the entry (XLA usually
# clones such a callee; a module need not).
_TWO_CALL_SITES = """HloModule two_calls

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  ROOT %t = (s32[], f32[4]) tuple(%p)
}

%twice (x: f32[4]) -> f32[4] {
  %x = f32[4] parameter(0)
  %w = (s32[], f32[4]) while(%x), condition=%cond, body=%body
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4] parameter(0)
  %a = f32[4] call(%x), to_apply=%twice
  ROOT %b = f32[4] call(%a), to_apply=%twice
}
"""


def test_a_computation_called_from_two_places_runs_for_each():
    runs, found, parent = fig.loops.loops(_TWO_CALL_SITES)
    assert runs["main"] == 1 and runs["twice"] == 2 and runs["body"] == 10
    assert found == [fig.loops.Loop(body="body", trips=5, runs=10, paths=2)]
    assert parent == {"body": ""}


def test_a_loop_whose_trip_count_is_data_is_counted_once():
    mesh, sharding = _one_chip()
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=sharding)

    def until_small(x):
        return jax.lax.while_loop(lambda x: jnp.max(x) > 1.0, lambda x: x * 0.5, x)
    program = fig.compile_program("while", jax.jit(until_small), (x,), mesh, lambda m: None)
    assert [x.trips for x in program.loops] == [None]
    assert program.flops == program.xla_flops


def test_micro_batches_count_every_micro_batch(data_parallel):
    """GradCache's two loops run once per micro-batch: the plan counts every run (the model's
    forward twice and backward once: more than the whole batch's step), collectives inside
    the loops included, and says so."""
    whole = data_parallel.to_json()
    micro = plan(tiny(micro_batch_size=4)).to_json()  # 4 of the batch's 16 rows: 4 runs
    assert sorted(x["runs"] for x in micro["loops"] if x["runs"] > 1) == [4, 4]
    xla = micro["xla_cost_analysis_per_chip"]
    assert xla["flops"] < whole["flops_per_chip"] < micro["flops_per_chip"]
    assert micro["flops_per_chip"] < 1.6 * whole["flops_per_chip"]
    assert any(c["runs"] == 4 for c in micro["collective_list"])
    assert "loop bodies counted as often as they run: 4, 4 times" in format_plan(micro)
    assert whole["loops"] == [] and "loop bodies" not in format_plan(whole)


def test_a_loop_body_that_cannot_be_costed_alone_leaves_the_raw_totals_and_says_so(monkeypatch):
    mesh, sharding = _one_chip()
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=sharding)

    def refuse(text, found, parent):
        raise RuntimeError("INVALID_ARGUMENT: Syntax error")
    monkeypatch.setattr(fig.loops, "loop_scale", refuse)
    said = []
    step = jax.jit(lambda x: _layers(x, jnp.ones((512, 512), x.dtype), 6, 1))
    program = fig.compile_program("loop", step, (x,), mesh, said.append)
    assert program.flops == program.xla_flops and program.loops == ()
    assert any("counted once" in m and "Syntax error" in m for m in said), said


def test_accumulated_halves_cost_the_whole_batch(data_parallel):
    """Gradient accumulation runs the same work as the whole batch in 4 pieces (each piece's
    negatives only its own: a smaller similarity product): counted as run, the FLOPs come
    within a few percent of the whole step's; counted once, one piece and the update."""
    whole = data_parallel.to_json()
    accumulated = plan(tiny(grad_accum_steps=4)).to_json()  # 4 rows a device, 1 a piece
    assert [x["runs"] for x in accumulated["loops"] if x["runs"] > 1] == [4]
    assert accumulated["flops_per_chip"] == pytest.approx(whole["flops_per_chip"], rel=0.05)
    raw = accumulated["xla_cost_analysis_per_chip"]["flops"]
    assert raw < 0.6 * whole["flops_per_chip"]
