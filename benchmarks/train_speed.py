"""SimCSE train-step throughput: jaxsim's step vs the same step in PyTorch, same run (CPU).

Both sides: all-MiniLM-L6-v2 (or a random-init `--shape`), fixed padding to `--max-len`, mean
pooling, dropout 0.1, cosine / 0.05 InfoNCE with in-batch negatives, global-norm clipping at 1.0,
AdamW (lr 3e-5, linear decay). jaxsim runs `jaxsim.train.step.make_train_step` built as
`train.py` builds it; PyTorch runs the reference step of `torch_reference.py`
(`transformers.BertModel` + the same loss + `torch.optim.AdamW`) twice: in float32, and under
`torch.autocast('cpu', dtype=torch.bfloat16)` (float32 master weights), the configuration a
PyTorch user picks for speed on a CPU with bf16 instructions. Inputs are tokenized once, so only
steps are timed. Rows (objective:dtype, jaxsim's compute dtype):

  unsup:float32    unsupervised: each of `--batch` sentences encoded twice (two dropout views)
  unsup:bfloat16   the same with bf16 compute (float32 master weights)
  sup:float32      supervised: (premise, entailment, contradiction) SNLI triplets, 3 views

For each row jaxsim and both PyTorch configurations run in turn `--repeats` times, `--steps`
steps each (`common.alternating`), each side in a process of its own (`common.ChildContender`),
all pinned to the same `--threads` cores. Each ratio
is the median [min, max] of the per-round ratios jaxsim steps/s / PyTorch steps/s: a row's
`vs_pytorch_float32`, `vs_pytorch_bfloat16`, `ratio` (PyTorch of the row's dtype) and
`vs_pytorch_best` (the faster PyTorch of its rounds). The headline `ratio` pairs each side at its
best: the unsup row whose jaxsim step is fastest against the faster PyTorch (bf16 vs bf16
autocast on a CPU with bf16 instructions; float32 where bf16 is emulated, autocast slower).

Packed (`--pack-length`, default max-len; 0 skips it): a second jaxsim contender in the same
rounds trains on the same batch packed end to end into rows of that many tokens
(`TrainConfig.pack_length`: the same vectors and loss, attention kept within each sentence; only
the dropout masks differ): the row's `packed_*` fields and the record's `packed_ratio`. PyTorch
(`transformers.BertModel`, eager attention) has no packed form and runs the padded batch.

Fraction of peak: FLOPs per step are XLA's cost analysis of the compiled step; achieved GFLOP/s
(FLOPs x steps/s) over the matrix-product peak of the row's dtype (`peak.py`, measured in this
process on the same threads: JAX's peak for jaxsim, PyTorch's for PyTorch, same FLOP count).
Peak RSS: each side's train loop in its own subprocess (getrusage; PyTorch's never imports JAX).

    python benchmarks/train_speed.py [--shape minilm|bert-base|tiny] [--threads 2] [--repeats 5]
        [--steps 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxsim import sharding
from jaxsim.data import readers
from jaxsim.data.batching import tokenize_examples
from jaxsim.formats.hf_folder import bundled_model_path, load_tokenizer
from jaxsim.models.encoder import init_params
from jaxsim.objectives import check_kwargs, get_objective
from jaxsim.storage.paths import SENTEVAL_ROOT
from jaxsim.train import build, optim
from jaxsim.train import state as state_lib
from jaxsim.train import step as step_lib
from jaxsim.train.config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_reference  # noqa: E402
from common import (  # noqa: E402
    SHAPES,
    ChildContender,
    alternating,
    available_cpus,
    best_vs_best,
    load_average,
    print_peak_memory,
    ratio_stats,
    serve_contender,
    set_threads,
    setup_process,
    status_mb,
    write_json,
    xla_flops,
)
from peak import describe, fraction_of_peak, measure_peaks  # noqa: E402

ROWS = ("unsup:float32", "unsup:bfloat16", "sup:float32")
OBJECTIVES = ("unsup", "sup")
# PyTorch's configurations: float32, and bf16 autocast (float32 master weights).
REFERENCES = ("float32", "bfloat16")
HERE = Path(__file__).resolve().parent


def parse_rows(text: str) -> list[tuple[str, str]]:
    rows = [tuple(r.split(":")) for r in text.split(",") if r]
    for row in rows:
        if len(row) != 2 or row[0] not in OBJECTIVES or row[1] not in ("float32", "bfloat16"):
            raise SystemExit(f"error: bad row {':'.join(row)!r}; objectives {OBJECTIVES}, "
                             f"dtypes float32, bfloat16")
    return rows


def examples(objective: str, batch: int) -> list:
    """The first `batch` unique SNLI dev sentences (unsup) or triplets (sup)."""
    if objective == "sup":
        return readers.build_snli_triplets(SENTEVAL_ROOT / "SNLI", ("dev",))[:batch]
    lines = readers.read_sentences(SENTEVAL_ROOT / "SNLI" / "s1.dev")
    return list(dict.fromkeys(s for s in lines if s.strip()))[:batch]


def tokenized(objective: str, batch: int, max_len: int) -> dict:
    """{'input_ids', 'attention_mask', 'token_type_ids'}: int32 [batch, views, max_len]."""
    return tokenize_examples(load_tokenizer(bundled_model_path()), examples(objective, batch),
                             max_len)


def build_step(objective: str, dtype: str, arrays: dict, mesh=None, **config):
    """The jitted jaxsim train step built as train.py builds it, its initial state and the batch
    placed on the mesh: `(train_step, state, placed_batch)`.

    `mesh`: default all local devices. `config`: extra TrainConfig fields (e.g. another PRNG
    implementation, or `random_init` with `model_overrides` for another architecture).
    """
    step_lib.configure_jax()
    batch, _, max_len = arrays["input_ids"].shape
    ref = torch_reference
    cfg = TrainConfig(model="bundled", pooler="avg", mlp_only_train=False, dropout=ref.DROPOUT,
                      objective=objective, dtype=dtype, data_format="senteval_corpus",
                      batch_size=batch, max_len=max_len, max_steps=ref.TOTAL_STEPS,
                      learning_rate=ref.LR, max_grad_norm=ref.CLIP, **config)
    base = build.load_base(cfg)
    encoder = build.make_encoder(cfg, base.config)
    obj = get_objective(objective)
    mesh = mesh if mesh is not None else sharding.make_mesh()
    options = step_lib.compiler_options(cfg.fast_compile)
    tx = optim.make_optimizer(cfg, ref.TOTAL_STEPS)
    root = jax.random.key(cfg.seed)
    params = init_params(encoder, jax.random.fold_in(root, 1),
                         state_lib.param_shardings(encoder, mesh), base.bert_params)
    state, shardings = state_lib.create_state(params, tx, jax.random.fold_in(root, 2), mesh,
                                              options)
    train_step = step_lib.make_train_step(
        loss=step_lib.LossSpec(
            encoder=encoder,
            objective=functools.partial(obj.loss, **check_kwargs(obj, {"temp": ref.TEMP})),
            views=obj.views),
        update=step_lib.UpdateSpec(tx=tx, schedule=optim.make_schedule(cfg, ref.TOTAL_STEPS)),
        target=step_lib.CompileTarget(mesh=mesh, state_shardings=shardings,
                                      compiler_options=options),
        split=step_lib.BatchSplit(mode="packed" if cfg.pack_length else "whole"))
    arrays = build.batch_preparer(cfg, obj, mesh)(arrays)
    shardings = step_lib.batch_shardings(mesh, packed=bool(cfg.pack_length))
    placed = {k: jax.device_put(v, shardings[k]) for k, v in arrays.items()}
    return train_step, state, placed


def jaxsim_config(args, packed: bool = False) -> dict:
    """TrainConfig fields for `--shape` (the bundled checkpoint, or a random-init architecture)
    and, `packed`, `--pack-length`."""
    config = {"pack_length": args.pack_length if packed else 0}
    if args.shape != "minilm":
        config.update(random_init=True, model_overrides=SHAPES[args.shape])
    return config


def jaxsim_step(objective: str, dtype: str, arrays: dict, **config):
    """(run, flops): a no-argument callable running one jaxsim train step (blocking), built by
    `build_step` and compiled ahead, and XLA's FLOP count of that compiled step."""
    train_step, state, placed = build_step(objective, dtype, arrays, **config)
    compiled = train_step.lower(state, placed).compile()
    holder = {"state": state}

    def run():
        holder["state"], metrics = compiled(holder["state"], placed)
        jax.block_until_ready(metrics["loss"])

    return run, xla_flops(compiled)


def torch_model(shape: str):
    if shape == "minilm":
        return torch_reference.load_model(str(bundled_model_path()))
    return torch_reference.load_model(config=SHAPES[shape])


def memory_child(objective: str, dtype: str, folder: Path, args) -> None:
    """Runs a few jaxsim steps on saved arrays and prints the process's memory figures."""
    arrays = dict(np.load(folder / f"{objective}.npz"))
    baseline = status_mb("VmRSS")
    run, _ = jaxsim_step(objective, dtype, arrays, **jaxsim_config(args))
    print_peak_memory(run, 3, baseline)


def contender_child(side: str, objective: str, dtype: str, folder: Path, args) -> None:
    """One side of a row in this (child) process: builds its step on the saved arrays, warms it
    up, then runs `--steps` steps per request of the parent (`common.serve_contender`)."""
    arrays = dict(np.load(folder / f"{objective}.npz"))
    info = {}
    if side.startswith("jaxsim"):
        start = time.perf_counter()
        step, info["flops"] = jaxsim_step(objective, dtype, arrays,
                                          **jaxsim_config(args, side == "jaxsim_packed"))
        info["compile_s"] = time.perf_counter() - start
        step()  # first run: allocations
    else:
        import torch

        torch.set_num_threads(args.threads)
        step = torch_reference.make_step(
            torch_model(args.shape), arrays, unsup=objective == "unsup",
            autocast_dtype=torch.bfloat16 if dtype == "bfloat16" else None)
        for _ in range(2):  # warm-up (allocator, first-call paths)
            step()
    serve_contender(lambda: [step() for _ in range(args.steps)], info)


def start_contender(side: str, objective: str, dtype: str, folder: Path,
                    args) -> ChildContender:
    return ChildContender([sys.executable, __file__, "--contender", side, f"{objective}:{dtype}",
                           str(folder), "--shape", args.shape, "--threads", str(args.threads),
                           "--steps", str(args.steps), "--pack-length", str(args.pack_length)])


def measure_row(objective: str, dtype: str, folder: Path, torch_sides: dict, peaks: dict,
                args) -> dict:
    """jaxsim's step (padded rows, as PyTorch runs; and packed with `--pack-length`) and both
    PyTorch steps, each in its own process, in alternating rounds: rates, ratios, peak shares."""
    ours = {side: start_contender(side, objective, dtype, folder, args)
            for side in ("jaxsim", "jaxsim_packed")[: 2 if args.pack_length else 1]}
    flops, compile_s = ours["jaxsim"].info["flops"], ours["jaxsim"].info["compile_s"]
    contenders = dict(ours)
    for ref in REFERENCES:
        contenders[f"pytorch_{ref}"] = torch_sides[(objective, ref)]
    try:
        rates = alternating(contenders, args.steps, args.repeats)
    finally:
        for side in ours.values():
            side.close()
    rows_per_step = args.batch * (2 if objective == "unsup" else 3)
    row = {"objective": objective, "dtype": dtype, "reference_dtype": dtype,
           "flops_per_step": flops, "compile_s": round(compile_s, 2), "repeats": args.repeats,
           "rates": {name: r["rates"] for name, r in rates.items()}}
    for name, r in rates.items():
        row[f"{name}_steps_per_s"] = r["per_s"]
        row[f"{name}_sentences_per_s"] = r["per_s"] * rows_per_step
    for ref in REFERENCES:
        row[f"vs_pytorch_{ref}"] = ratio_stats(rates["jaxsim"]["rates"],
                                               rates[f"pytorch_{ref}"]["rates"])
    row.update({k: row[f"vs_pytorch_{dtype}"][k] for k in ("ratio", "ratio_min", "ratio_max")})
    references = [f"pytorch_{ref}" for ref in REFERENCES]
    # Against the faster PyTorch of these rounds (without bf16 instructions: float32).
    row["vs_pytorch_best"] = best_vs_best(rates, ["jaxsim"], references)
    row["peak_gflops"] = peaks["jax"][dtype]
    row["jaxsim_gflops"] = flops * row["jaxsim_steps_per_s"] / 1e9
    row["fraction_of_peak"] = fraction_of_peak(flops, row["jaxsim_steps_per_s"],
                                               row["peak_gflops"])
    for ref in REFERENCES:  # PyTorch against its own peak, same FLOP count
        row[f"pytorch_{ref}_fraction_of_peak"] = fraction_of_peak(
            flops, row[f"pytorch_{ref}_steps_per_s"], peaks["torch"][ref])
    if "jaxsim_packed" in ours:  # the same examples and loss, no padding computed
        packed_flops = ours["jaxsim_packed"].info["flops"]
        row["packed_flops_per_step"] = packed_flops
        row["packed_fraction_of_peak"] = fraction_of_peak(
            packed_flops, row["jaxsim_packed_steps_per_s"], row["peak_gflops"])
        for ref in REFERENCES:
            row[f"packed_vs_pytorch_{ref}"] = ratio_stats(rates["jaxsim_packed"]["rates"],
                                                          rates[f"pytorch_{ref}"]["rates"])
        row["packed_vs_pytorch_best"] = best_vs_best(rates, ["jaxsim_packed"], references)
    return row


def report_row(row: dict, memory: dict) -> None:
    """Adds the row's peak-RSS figures (when measured) and prints it."""
    objective, dtype = row["objective"], row["dtype"]
    if memory:
        row["jaxsim_memory"] = memory[("jaxsim", objective, dtype)]
        for ref in REFERENCES:
            row[f"pytorch_{ref}_memory"] = memory[("torch", objective, ref)]
    print_row(row)
    if memory:
        print(f"      peak RSS jaxsim {row['jaxsim_memory']['peak_rss_mb']:.0f} MB, PyTorch "
              f"fp32 {row['pytorch_float32_memory']['peak_rss_mb']:.0f} MB, bf16 autocast "
              f"{row['pytorch_bfloat16_memory']['peak_rss_mb']:.0f} MB", flush=True)


def _ratios(row: dict, prefix: str = "") -> str:
    fp32, bf16 = (row[f"{prefix}vs_pytorch_{ref}"] for ref in REFERENCES)
    return "  ".join(f"ratio vs {name} {r['ratio']:.2f}x [{r['ratio_min']:.2f}-"
                     f"{r['ratio_max']:.2f}]" for name, r in (("fp32", fp32), ("bf16", bf16)))


def print_row(row: dict) -> None:
    print(f"{row['objective']:5s} {row['dtype']:8s}  jaxsim {row['jaxsim_steps_per_s']:.3f} "
          f"steps/s ({row['fraction_of_peak']:.0%} of peak)  PyTorch fp32 "
          f"{row['pytorch_float32_steps_per_s']:.3f}, bf16 autocast "
          f"{row['pytorch_bfloat16_steps_per_s']:.3f} steps/s  {_ratios(row)}  compile "
          f"{row['compile_s']:.1f} s", flush=True)
    if "packed_vs_pytorch_bfloat16" in row:
        print(f"      packed: jaxsim {row['jaxsim_packed_steps_per_s']:.3f} steps/s "
              f"({row['packed_fraction_of_peak']:.0%} of peak)  {_ratios(row, 'packed_')}",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated objective:dtype rows (default {','.join(ROWS)})")
    parser.add_argument("--shape", default="minilm", choices=("minilm", *SHAPES),
                        help="minilm: the bundled model; bert-base / tiny: random init")
    parser.add_argument("--batch", type=int, default=64, help="examples per step")
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--pack-length", type=int, default=None,
                        help="also time jaxsim on rows packed to this many tokens (default "
                             "max-len: the least attention work; 0: padded rows only)")
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for both sides (the process is pinned to them)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--peak-size", type=int, default=2048, help="peak product size")
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--rss-child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--contender", nargs=3, default=None, help=argparse.SUPPRESS)
    # Each side in its own process: in one process PyTorch's allocations slowed jaxsim's later
    # rounds (docs/performance.md).
    args = parser.parse_args()
    setup_process()
    if args.pack_length is None:
        args.pack_length = args.max_len
    rows = parse_rows(args.rows)
    set_threads(args.threads)  # before JAX's backend and torch's pool start
    if args.rss_child:
        (objective, dtype), folder = args.rss_child[0].split(":"), Path(args.rss_child[1])
        memory_child(objective, dtype, folder, args)
        return
    if args.contender:
        side, row, folder = args.contender
        contender_child(side, *row.split(":"), Path(folder), args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run(rows, args, Path(tmp))


def run(rows, args, folder: Path) -> None:
    """Every row's figures into `--json`; `folder` holds the batches the children read."""
    load = load_average()
    print(f"threads {args.threads} (this process may use {available_cpus()} CPUs), shape "
          f"{args.shape}, batch {args.batch}, max_len {args.max_len}, 1-min load average before "
          f"the run {'n/a' if load is None else f'{load:.2f}'}", flush=True)
    for objective in sorted({o for o, _ in rows}):
        np.savez(folder / f"{objective}.npz", **tokenized(objective, args.batch, args.max_len))
    memory = {} if args.no_rss else measure_memory(rows, args, folder)

    import torch

    torch.set_num_threads(args.threads)
    peaks = measure_peaks(args.peak_size, args.peak_repeats)
    print(describe(peaks), flush=True)
    record = {"threads": args.threads, "batch": args.batch, "max_len": args.max_len,
              "pack_length": args.pack_length, "steps_per_repeat": args.steps,
              "shape": args.shape, "model": "all-MiniLM-L6-v2" if args.shape == "minilm" else
              f"random init, {args.shape}", "peak_gflops": peaks, "rows": {}}
    torch_sides = {}
    try:
        for objective, dtype in rows:
            for ref in REFERENCES:
                if (objective, ref) not in torch_sides:
                    torch_sides[(objective, ref)] = start_contender("pytorch", objective, ref,
                                                                    folder, args)
            record["rows"][f"{objective}:{dtype}"] = row = measure_row(
                objective, dtype, folder, torch_sides, peaks, args)
            report_row(row, memory)
    finally:
        for side in torch_sides.values():
            side.close()
    # Headline: each side at its best (see the module docstring).
    unsup = [r for r in record["rows"].values() if r["objective"] == "unsup"]
    headline = max(unsup or record["rows"].values(), key=lambda r: r["jaxsim_steps_per_s"])
    best = headline["vs_pytorch_best"]
    record["ratio"] = best["ratio"]
    if "packed_vs_pytorch_best" in headline:
        record["packed_ratio"] = headline["packed_vs_pytorch_best"]["ratio"]
    record.update(ratio_row=f"{headline['objective']}:{headline['dtype']}",
                  ratio_reference=best["reference"])
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(args.json, record)


def measure_memory(rows, args, folder: Path) -> dict:
    """{(side, objective, dtype): memory figures}, each side in its own subprocess, on the
    batches saved in `folder`."""
    out = {}
    for objective in sorted({o for o, _ in rows}):
        for ref in REFERENCES:
            model = (["--model", str(bundled_model_path())] if args.shape == "minilm"
                     else ["--shape", args.shape])
            cmd = [sys.executable, str(HERE / "torch_reference.py"), "--arrays",
                   str(folder / f"{objective}.npz"), *model, "--tokenizer",
                   str(bundled_model_path()), "--autocast", ref, "--threads", str(args.threads)]
            out[("torch", objective, ref)] = _child(cmd)
    for objective, dtype in rows:
        cmd = [sys.executable, __file__, "--rss-child", f"{objective}:{dtype}", str(folder),
               "--shape", args.shape, "--threads", str(args.threads),
               "--pack-length", str(args.pack_length)]
        out[("jaxsim", objective, dtype)] = _child(cmd)
    return out


def _child(cmd: list) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RSS ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory subprocess {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RSS "):])


if __name__ == "__main__":
    main()
