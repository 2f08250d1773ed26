"""Where an encode pass's time goes: the op-level breakdown of `jaxsim.encode`'s programs (CPU).

The pass is `jaxsim.encode(..., normalize=True)` over one of `encode_speed.py`'s sentence sets,
on the bundled all-MiniLM-L6-v2, in the batches `jaxsim.encode` lays out (packed or padded rows,
the CPU token budget). The batches of each compiled program (one per batch shape) run one at a
time: once to warm up, once timed, once under `jax.profiler.trace`. Each XLA op event is summed
per HLO instruction and classified as `step_profile.py` classifies a train step's forward ops
(dense products, attention softmax + layout, layer norm, GELU, copies, embedding gathers, other).

Reported per pass: XLA's FLOPs (cost analysis), the wall time of the one-batch-at-a-time pass
(`jaxsim.encode` itself runs two at once on one CPU device, so it is faster), op time per
category, the dense products' share of op time, their rate (the pass's FLOPs over their op time:
the products hold nearly all FLOPs) and `bound`: op time over the products' op time, the most
the pass could gain if nothing but the products took time. The --json record's 'ratio' is the
dense share. XLA's pool runs ops at the same time, so summed op time is not wall time.

    python benchmarks/encode_profile.py [--set stsb_test] [--dtype float32] [--limit N]
        [--batch-size 64] [--threads N] [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_profile as sp  # noqa: E402
from common import (  # noqa: E402
    available_cpus,
    load_average,
    set_threads,
    setup_process,
    write_json,
    xla_flops,
)
from encode_speed import batches_by_shape, long_texts, stsb_test_sentences  # noqa: E402

SETS = ("stsb_test", "long_64_128")


def sentence_set(name: str, model) -> list[str]:
    from jaxsim.storage.paths import SENTEVAL_ROOT

    if name == "stsb_test":
        return stsb_test_sentences(SENTEVAL_ROOT)
    return long_texts(SENTEVAL_ROOT, model.tokenizer)


def profile(model, sentences: list[str], batch_size: int, dtype: str) -> dict:
    from jaxsim.encode import _place_params, _to_mesh, make_encode_fn

    mesh, groups = batches_by_shape(model, sentences, batch_size)
    params = jax.tree.map(lambda p: p.astype(dtype), _place_params(model.params, mesh))
    fn = make_encode_fn(model.encoder.clone(dtype=jnp.dtype(dtype)), True, False, mesh)
    key = jax.random.key(0)
    flops, wall, op_ms = 0.0, 0.0, collections.Counter()
    top, shapes = [], []
    for tokens, batches in groups.items():
        args = [(params, _to_mesh(b.tokens, mesh), key) for b in batches]
        compiled = fn.lower(*args[0]).compile()

        def run():
            for a in args:
                jax.block_until_ready(compiled(*a))

        run()  # warm-up
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        hlo = compiled.as_text()
        module = hlo.split(None, 2)[1].rstrip(",") if hlo.startswith("HloModule") else None
        with tempfile.TemporaryDirectory() as folder:
            with jax.profiler.trace(folder):
                run()
            planes = sorted(Path(folder).rglob("*.xplane.pb"))
            times = sp.op_times_ns(planes[-1], module) if planes else collections.Counter()
        if not times:
            raise SystemExit("error: the trace has no per-op events on this backend")
        table = sp.breakdown(times, hlo, steps=1, forward_only=True)
        for row in table["categories"]:
            op_ms[row["category"]] += row["ms_per_step"]
        top += [{**row, "shape": list(tokens)} for row in table["top_instructions"]]
        flops += xla_flops(compiled) * len(batches)
        wall += seconds
        shapes.append({"tokens": list(tokens), "batches": len(batches),
                       "wall_s": round(seconds, 4)})
    total = sum(op_ms.values())
    dense = op_ms[sp.DENSE_FWD]
    categories = [{"category": c, "ms": round(op_ms[c], 3), "share": op_ms[c] / total}
                  for c in sp.CATEGORIES if op_ms[c] > 0]
    top.sort(key=lambda row: -row["ms_per_step"])
    return {"sentences": len(sentences), "flops": flops, "wall_s": round(wall, 4),
            "sentences_per_s": len(sentences) / wall, "op_ms": round(total, 3),
            "categories": categories, "dense_share": dense / total,
            "dense_gflops": flops / (dense / 1e3) / 1e9 if dense else None,
            "bound": total / dense if dense else None, "top_instructions": top[:10],
            "shapes": shapes}


def report(record: dict) -> None:
    print(f"{record['sentences']} sentences, {record['flops'] / 1e9:.1f} GFLOP a pass; one batch "
          f"at a time {record['wall_s']:.2f} s ({record['sentences_per_s']:.1f} sentences/s), "
          f"{len(record['shapes'])} program(s)")
    print(f"op time by category ({record['op_ms']:.1f} ms summed; ops overlap across threads, "
          f"so the sum is not the wall time):")
    for row in record["categories"]:
        print(f"  {row['category']:32s} {row['ms']:9.2f} ms  {100 * row['share']:5.1f}%")
    print(f"dense products: {100 * record['dense_share']:.1f}% of op time, "
          f"{record['dense_gflops']:.1f} GFLOP/s; bound (op time / product time) "
          f"{record['bound']:.2f}x")
    print("most expensive instructions (ms a pass, category, op_name):")
    for row in record["top_instructions"]:
        print(f"  {row['ms_per_step']:8.2f}  {row['instruction'][:28]:28s} {row['category']:29s} "
              f"{sp.short_op_name(row['op_name'])}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", choices=SETS, default=SETS[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--limit", type=int, default=0, help="keep the first N sentences (0: all)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for XLA (the process is pinned to them)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    setup_process()
    if args.limit < 0 or args.batch_size < 1:
        parser.error("--limit must be >= 0 and --batch-size >= 1")
    set_threads(args.threads)  # before XLA starts its thread pool
    import jaxsim
    from jaxsim.formats.hf_folder import bundled_model_path

    load = load_average()
    model = jaxsim.load_pretrained(str(bundled_model_path()))
    sentences = sentence_set(args.set, model)
    sentences = sentences[: args.limit] if args.limit else sentences
    print(f"{args.set} {args.dtype}, batch {args.batch_size}, threads {args.threads}, 1-min load "
          f"average before the run {'n/a' if load is None else f'{load:.2f}'}", flush=True)
    record = profile(model, sentences, args.batch_size, args.dtype)
    record.update({"set": args.set, "dtype": args.dtype, "batch_size": args.batch_size,
                   "threads": args.threads, "model": "all-MiniLM-L6-v2",
                   "platform": jax.default_backend(),
                   "ratio": record["dense_share"]})  # as step_profile's record
    report(record)
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
