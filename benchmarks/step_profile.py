"""Where a SimCSE train step's time goes: XLA's totals and an op-level breakdown (CPU).

The step is jaxsim's train step on the bundled all-MiniLM-L6-v2, built as `train.py` builds it
(`train_speed.build_step`: mean pooling, dropout 0.1, cosine / 0.05 InfoNCE, clipping 1.0,
AdamW), on the first `--batch` SNLI dev sentences (unsup) or triplets (sup), padded to
`--max-len`. It reports:

  totals     from the compiled step (independent of the machine's load): XLA's FLOPs and
             bytes accessed (`cost_analysis()`), temporary buffers (`memory_analysis()`); and
             the wall time per step (median of `--steps` steps after a warm-up step).
  breakdown  `--steps` more steps run under `jax.profiler.trace`; each XLA op event's duration is
             summed per HLO instruction and divided by the steps (control flow left out: its
             bodies' instructions are events of their own). Each instruction is classified from the
             optimized HLO: its opcode, what it calls (fusion and loop bodies) and their
             `op_name`s. Categories: dense products forward / backward (dots, matmul custom calls,
             fusions with a dot; backward under 'transpose(jvp'), dropout masks (threefry bits, the
             hash's rolled loop too), embedding lookup and gradient (take, scatter), copies /
             transposes / casts, GELU (erf), layer norm, attention softmax + layout (scale, mask,
             softmax, the q/k/v bias and split), gradient norm + AdamW update (in the step's
             lax.cond), other; the first that matches wins (a product fused with the softmax's max
             is a product).

XLA's threads run ops at the same time, so summed op time is not wall time (shares are of it).
The --json record's "ratio" is the dense products' share (forward + backward; 1.0 = bound by its
products). Without per-op events in the trace the totals are still reported, the breakdown not.

    python benchmarks/step_profile.py [--objective unsup|sup] [--dtype float32|bfloat16]
        [--batch 64] [--max-len 32] [--steps 6] [--threads N] [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

from jaxsim.plan import hlo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    available_cpus,
    cost_analysis,
    load_average,
    set_threads,
    setup_process,
    write_json,
)
from train_speed import build_step, tokenized  # noqa: E402

DENSE_FWD, DENSE_BWD = "dense products, forward", "dense products, backward"
DROPOUT, EMBED = "dropout masks (threefry bits)", "embedding lookup / gradient"
COPIES, GELU, LAYER_NORM = "copies / transposes / casts", "GELU (erf)", "layer norm"
SOFTMAX, OPTIMIZER, OTHER = "attention softmax + layout", "gradient norm + AdamW update", "other"
CATEGORIES = (DENSE_FWD, DENSE_BWD, DROPOUT, EMBED, COPIES, GELU, LAYER_NORM, SOFTMAX, OPTIMIZER,
              OTHER)
CONTROL_FLOW = frozenset({"while", "conditional", "call"})
DENSE_OPS = frozenset({"dot", "convolution"})
# Opcodes that only move, reshape or cast data: a fusion of nothing else is a copy.
MOVES = frozenset({"parameter", "constant", "copy", "convert", "transpose", "bitcast", "reshape",
                   "slice",
                   "concatenate", "broadcast", "dynamic-slice", "dynamic-update-slice", "pad",
                   "tuple", "get-tuple-element", "iota", "reverse", "copy-start", "copy-done"})
# The update runs in the step's lax.cond ('cond/branch_N_fun'); optax's own scope names.
OPTAX_NAMES = ("cond/branch_", "adam", "scale_by", "clip_by", "apply_updates")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"(?<![\w.\-%])([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


# ---------------------------------------------------------------------------------------------
# The optimized HLO: what each instruction is.
# ---------------------------------------------------------------------------------------------

def parse_hlo(text: str) -> dict:
    """{instruction name: {'opcode', 'op_name', 'target', 'type', 'calls', 'computation'}} of
    every instruction in an HLO module's text."""
    out = {}
    for computation, lines in hlo.computations(text).items():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            name, rest = m.groups()
            opcode = _OPCODE.search(rest)
            calls = _CALLED.findall(rest)
            for group in _CALLED_LIST.findall(rest):
                calls += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
            target = _TARGET.search(rest)
            out[name] = {"opcode": opcode.group(1) if opcode else "",
                         "type": rest[:opcode.start()].strip() if opcode else "",
                         "op_name": hlo.op_name(rest), "target": target.group(1) if target else "",
                         "calls": calls, "computation": computation}
    return out


def _bodies(instructions: dict) -> dict:
    """{computation: (opcodes, op_names, custom-call targets)} including what it calls."""
    direct = collections.defaultdict(lambda: (set(), set(), set(), set()))
    for info in instructions.values():
        ops, names, targets, calls = direct[info["computation"]]
        ops.add(info["opcode"])
        names.add(info["op_name"])
        targets.add(info["target"])
        calls.update(info["calls"])
    done: dict = {}

    def close(comp, seen):
        if comp in done:
            return done[comp]
        ops, names, targets, calls = (set(x) for x in direct.get(comp, ((), (), (), ())))
        for callee in calls - seen:
            o, n, t = close(callee, seen | {comp})
            ops |= o
            names |= n
            targets |= t
        done[comp] = (ops, names, targets)
        return done[comp]

    for comp in list(direct):
        close(comp, frozenset())
    return done


def _rng_loop_computations(instructions: dict, bodies: dict) -> set:
    """Computations run by a random-bits loop, and what they call.

    On XLA:CPU jax lowers the threefry2x32 hash to a rolled loop over its rounds whose
    instructions carry no 'threefry' in their op_name: a loop is taken for one when it names
    threefry or carries uint32 arrays without any product inside (a loop over micro-batches
    holds the model's products).
    """
    calls = collections.defaultdict(set)
    for info in instructions.values():
        calls[info["computation"]].update(info["calls"])
    out: set = set()
    for info in instructions.values():
        if info["opcode"] != "while":
            continue
        ops, names = set(), {info["op_name"]}
        for callee in info["calls"]:
            o, n, _ = bodies.get(callee, (set(), set(), set()))
            ops, names = ops | o, names | n
        if any("threefry" in n for n in names) or (re.search(r"\bu32\[\d", info["type"])
                                                   and not ops & DENSE_OPS):
            stack = list(info["calls"])
            while stack:
                comp = stack.pop()
                if comp not in out:
                    out.add(comp)
                    stack.extend(calls[comp])
    return out


def _is_matmul_call(target: str) -> bool:
    return bool(re.search(r"matmul|gemm|dot|conv", target, re.I))


def classify(info: dict, body_ops: set, body_names: set, body_targets: set,
             in_rng_loop: bool = False, forward_only: bool = False) -> str:
    """The category of one instruction, from its own opcode and op_name, those of what it
    calls (fusion or loop bodies), and whether it runs inside a random-bits loop
    (`forward_only`: a program without gradients or optimizer, e.g. an encode pass)."""
    own, opcode = info.get("op_name", ""), info.get("opcode", "")
    names = " ".join([own, *body_names])
    ops = set(body_ops) or {opcode}  # a fusion is what it fuses
    targets = body_targets | {info.get("target", "")}
    if (ops | {opcode}) & DENSE_OPS or any(_is_matmul_call(t) for t in targets if t):
        direction = own or next((n for n in body_names if n), "")
        return DENSE_BWD if "transpose(jvp" in direction else DENSE_FWD
    if not forward_only and (any(k in own for k in OPTAX_NAMES) or (
            own and "jvp(" not in own and "threefry" not in own and "_take" not in own)):
        return OPTIMIZER
    if (in_rng_loop or "threefry" in names or "_dropout" in names or "random_bits" in names
            or "rng-bit-generator" in ops
            or (info.get("type", "").startswith("u32[") and "jvp(" in own)):
        return DROPOUT
    if "_take" in names or ops & {"gather", "scatter"}:
        return EMBED
    if ops <= MOVES:
        return COPIES
    if "erf" in ops or "gelu" in names.lower():
        return GELU
    if "LayerNorm" in names:
        return LAYER_NORM
    if "attention/self" in own or "softmax" in names:
        return SOFTMAX
    return OTHER


# ---------------------------------------------------------------------------------------------
# The trace: time per instruction.
# ---------------------------------------------------------------------------------------------

def op_times_ns(xplane: Path, module: str) -> collections.Counter:
    """{HLO instruction name: summed event duration (ns)} of `module`'s ops in a trace.

    Events carrying an 'hlo_op' stat; where the trace has device 'XLA Ops' lines (GPU, TPU),
    only those (a kernel may also appear on its stream's line).
    """
    data = jax.profiler.ProfileData.from_file(str(xplane))
    lines = [line for plane in data.planes for line in plane.lines]
    device = [line for line in lines if line.name == "XLA Ops"]
    times: collections.Counter = collections.Counter()
    for line in device or lines:
        for event in line.events:
            stats = dict(event.stats)
            op, owner = stats.get("hlo_op"), stats.get("hlo_module")
            if op is None or (module and owner is not None and not str(owner).startswith(module)):
                continue
            times[str(op)] += event.duration_ns
    return times


def breakdown(times: collections.Counter, hlo_text: str, steps: int,
              forward_only: bool = False) -> dict:
    """Per-step category table and top instructions from op times and the optimized HLO
    (`forward_only`: see `classify`)."""
    instructions = parse_hlo(hlo_text)
    bodies = _bodies(instructions)
    rng_loops = _rng_loop_computations(instructions, bodies)
    per_category: collections.Counter = collections.Counter()
    rows, control_ns = [], 0
    for name, ns in times.items():
        info = instructions.get(name, {})
        if info.get("opcode") in CONTROL_FLOW:
            control_ns += ns
            continue
        ops, names, targets = set(), set(), set()
        for callee in info.get("calls", []):
            o, n, t = bodies.get(callee, (set(), set(), set()))
            ops, names, targets = ops | o, names | n, targets | t
        category = classify(info, ops, names - {""}, targets - {""},
                            info.get("computation") in rng_loops, forward_only)
        ms = ns / 1e6 / steps
        per_category[category] += ms
        rows.append({"instruction": name, "category": category, "ms_per_step": ms,
                     "opcode": info.get("opcode", "?"), "op_name": info.get("op_name", "")})
    total = sum(per_category.values())
    table = [{"category": c, "ms_per_step": round(per_category[c], 3),
              "share": per_category[c] / total if total else 0.0}
             for c in CATEGORIES if per_category[c] > 0]
    rows.sort(key=lambda r: -r["ms_per_step"])
    top = [{**r, "ms_per_step": round(r["ms_per_step"], 3),
            "share": r["ms_per_step"] / total if total else 0.0} for r in rows[:10]]
    dense = per_category[DENSE_FWD] + per_category[DENSE_BWD]
    return {"op_ms_per_step": round(total, 3), "categories": table, "top_instructions": top,
            "dense_share": dense / total if total else 0.0, "instructions_timed": len(rows),
            # The spans of while/conditional/call events, which hold their bodies' events.
            "control_flow_span_ms_per_step": round(control_ns / 1e6 / steps, 3)}


def short_op_name(op_name: str, width: int = 64) -> str:
    """The op_name without the 'jit(train_step)/' prefix and the model's scope noise, cut to
    `width` characters from the left."""
    text = op_name.replace("jit(train_step)/", "").replace("SentenceEncoder", "Enc")
    text = text.replace("bert/encoder/", "").replace("transpose(jvp(Enc))", "bwd")
    text = text.replace("jvp(Enc)", "fwd")
    return text if len(text) <= width else "..." + text[-(width - 3):]


# ---------------------------------------------------------------------------------------------
# The run.
# ---------------------------------------------------------------------------------------------

def totals(compiled) -> dict:
    """FLOPs, bytes accessed and temp memory of a compiled step (None where not reported)."""
    cost = cost_analysis(compiled)
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    return {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
            "temp_bytes": temp}


# --tiny: a small random BERT with the bundled tokenizer's vocabulary (the test's model).
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 128}


def profile(objective: str, dtype: str, batch: int, max_len: int, steps: int,
            tiny: bool = False, pack_length: int = 0) -> dict:
    arrays = tokenized(objective, batch, max_len)
    config = {"random_init": True, "model_overrides": TINY} if tiny else {}
    config["pack_length"] = pack_length
    train_step, state, placed = build_step(objective, dtype, arrays, **config)
    start = time.perf_counter()
    compiled = train_step.lower(state, placed).compile()
    record = {"compile_s": round(time.perf_counter() - start, 2), **totals(compiled)}

    def one():
        nonlocal state
        state, metrics = compiled(state, placed)
        jax.block_until_ready(metrics["loss"])

    one()  # warm-up
    walls = []
    for _ in range(steps):
        begin = time.perf_counter()
        one()
        walls.append(time.perf_counter() - begin)
    record["wall_ms_per_step"] = round(1e3 * statistics.median(walls), 2)
    hlo = compiled.as_text()
    module = hlo.split(None, 2)[1].rstrip(",") if hlo.startswith("HloModule") else None
    times: collections.Counter = collections.Counter()
    reason = "the trace has no per-op events on this backend"
    try:
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder):
                for _ in range(steps):
                    one()
            planes = sorted(Path(folder).rglob("*.xplane.pb"))
            times = op_times_ns(planes[-1], module) if planes else times
    except (RuntimeError, ValueError, OSError) as error:  # no profiler on this backend
        reason = f"tracing failed: {error}".splitlines()[0]
    record["breakdown"] = breakdown(times, hlo, steps) if times else None
    if not times:
        record["breakdown_unavailable"] = reason
    return record


def report(record: dict) -> None:
    gib = 2.0 ** 30
    if None in (record["flops"], record["bytes_accessed"], record["temp_bytes"]):
        print(f"XLA totals per step: flops {record['flops']}, bytes accessed "
              f"{record['bytes_accessed']}, temp bytes {record['temp_bytes']} (not all reported)")
    else:
        print(f"XLA totals per step: {record['flops'] / 1e9:.2f} GFLOP, "
              f"{record['bytes_accessed'] / gib:.2f} GiB accessed, temp buffers "
              f"{record['temp_bytes'] / gib:.3f} GiB")
    print(f"wall time per step: {record['wall_ms_per_step']:.1f} ms (median of "
          f"{record['steps']}); compile {record['compile_s']:.1f} s")
    table = record["breakdown"]
    if table is None:
        print(f"op breakdown unavailable: {record['breakdown_unavailable']}")
        return
    print(f"\nop time per step by category ({table['op_ms_per_step']:.1f} ms summed over "
          f"{table['instructions_timed']} instructions; ops overlap across threads, so the sum "
          f"is not the wall time):")
    for row in table["categories"]:
        print(f"  {row['category']:32s} {row['ms_per_step']:9.2f} ms  {100 * row['share']:5.1f}%")
    print(f"  dense products (forward + backward): {100 * table['dense_share']:.1f}% of op time")
    print("\nmost expensive instructions (ms per step, share, category, op_name):")
    for row in table["top_instructions"]:
        print(f"  {row['ms_per_step']:8.2f} {100 * row['share']:5.1f}%  "
              f"{row['instruction'][:28]:28s} {row['category']:29s} "
              f"{short_op_name(row['op_name'])}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objective", choices=("unsup", "sup"), default="unsup")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch", type=int, default=64, help="examples per step")
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, then traced steps")
    parser.add_argument("--pack-length", type=int, default=0,
                        help="pack each batch's sentences into rows of this many tokens "
                             "(TrainConfig.pack_length; 0: padded rows)")
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for XLA (the process is pinned to them)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random BERT ({TINY}) instead of all-MiniLM-L6-v2 (tests)")
    args = parser.parse_args(argv)
    setup_process()
    for flag, value in (("--batch", args.batch), ("--max-len", args.max_len),
                        ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    set_threads(args.threads)  # before XLA starts its thread pool
    load = load_average()
    print(f"{args.objective} {args.dtype}, batch {args.batch}, max_len {args.max_len}, threads "
          f"{args.threads}, 1-min load average before the run "
          f"{'n/a' if load is None else f'{load:.2f}'}", flush=True)
    record = profile(args.objective, args.dtype, args.batch, args.max_len, args.steps,
                     args.tiny, args.pack_length)
    record.update({"objective": args.objective, "dtype": args.dtype, "batch": args.batch,
                   "max_len": args.max_len, "pack_length": args.pack_length, "steps": args.steps,
                   "threads": args.threads,
                   "model": "tiny" if args.tiny else "all-MiniLM-L6-v2",
                   "platform": jax.default_backend()})
    report(record)
    table = record["breakdown"]
    record["ratio"] = table["dense_share"] if table else None
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
