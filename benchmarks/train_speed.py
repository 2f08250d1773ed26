"""SimCSE train-step throughput: jaxsim's step vs the same step in PyTorch, one process (CPU).

Both sides: all-MiniLM-L6-v2, fixed padding to `--max-len`, mean pooling, dropout 0.1, cosine /
0.05 InfoNCE with in-batch negatives, global-norm clipping at 1.0, AdamW (lr 3e-5, linear decay).
jaxsim runs `jaxsim.train.step.make_train_step` built as `train.py` builds it; PyTorch runs the
reference step of `torch_reference.py` (`transformers.BertModel` + the same loss +
`torch.optim.AdamW`). Inputs are tokenized once, so only steps are timed. Rows (objective:dtype):

  unsup:float32    unsupervised: each of `--batch` sentences encoded twice (two dropout views)
  unsup:bfloat16   the same with bf16 compute (float32 master weights), vs PyTorch float32
  sup:float32      supervised: (premise, entailment, contradiction) SNLI triplets, 3 views

For each row the sides run alternately `--repeats` times, `--steps` steps each
(`common.alternating_rates`): ratio = jaxsim steps/s / PyTorch steps/s (median, min, max).
Peak RSS of each side's train loop is measured in its own subprocess (resource.getrusage; the
PyTorch one never imports JAX).

    python benchmarks/train_speed.py [--threads 2] [--repeats 5] [--steps 3] [--json out.json]
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
from jaxsim.io.hf_folder import bundled_model_path, load_tokenizer
from jaxsim.models.encoder import init_params
from jaxsim.objectives import check_kwargs, get_objective
from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.train import build, optim, state as state_lib, step as step_lib
from jaxsim.train.config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_reference  # noqa: E402
from common import (alternating_rates, available_cpus, load_average,  # noqa: E402
                    print_peak_memory, seconds, set_threads, status_mb, write_json)

ROWS = ("unsup:float32", "unsup:bfloat16", "sup:float32")
OBJECTIVES = ("unsup", "sup")
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
        encoder, functools.partial(obj.loss, **check_kwargs(obj, {"temp": ref.TEMP})), tx,
        views=obj.views, mesh=mesh, state_shardings=shardings,
        schedule=optim.make_schedule(cfg, ref.TOTAL_STEPS), compiler_options=options)
    placed = {k: jax.device_put(v, s) for (k, v), s in
              zip(arrays.items(), step_lib.batch_shardings(mesh).values())}
    return train_step, state, placed


def jaxsim_step(objective: str, dtype: str, arrays: dict, **config):
    """A no-argument callable running one jaxsim train step (blocking), built by `build_step`."""
    train_step, state, placed = build_step(objective, dtype, arrays, **config)
    holder = {"state": state}

    def run():
        holder["state"], metrics = train_step(holder["state"], placed)
        jax.block_until_ready(metrics["loss"])

    return run


def memory_child(objective: str, dtype: str, folder: Path) -> None:
    """Runs a few jaxsim steps on saved arrays and prints the process's memory figures."""
    arrays = dict(np.load(folder / f"{objective}.npz"))
    baseline = status_mb("VmRSS")
    print_peak_memory(jaxsim_step(objective, dtype, arrays), 3, baseline)



def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated objective:dtype rows (default {','.join(ROWS)})")
    parser.add_argument("--batch", type=int, default=64, help="examples per step")
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for both sides (the process is pinned to them)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--rss-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = parse_rows(args.rows)
    set_threads(args.threads)  # before JAX's backend and torch's pool start
    if args.rss_child:
        (objective, dtype), folder = args.rss_child[0].split(":"), Path(args.rss_child[1])
        memory_child(objective, dtype, folder)
        return
    load = load_average()
    print(f"threads {args.threads} (this process may use {available_cpus()} CPUs), batch "
          f"{args.batch}, max_len {args.max_len}, 1-min load average before the run "
          f"{'n/a' if load is None else f'{load:.2f}'}", flush=True)
    memory = {} if args.no_rss else measure_memory(rows, args)

    import torch

    torch.set_num_threads(args.threads)
    model_path = str(bundled_model_path())
    record = {"threads": args.threads, "batch": args.batch, "max_len": args.max_len,
              "steps_per_repeat": args.steps, "model": "all-MiniLM-L6-v2", "rows": {}}
    torch_runs = {}
    for objective, dtype in rows:
        arrays = tokenized(objective, args.batch, args.max_len)
        if objective not in torch_runs:
            torch_runs[objective] = torch_reference.make_step(
                torch_reference.load_model(model_path), arrays, unsup=objective == "unsup")
            for _ in range(2):  # warm-up (allocator, first-call paths)
                torch_runs[objective]()
        theirs_one = torch_runs[objective]
        ours_one = jaxsim_step(objective, dtype, arrays)
        first = seconds(ours_one)  # compile + one step
        warm = seconds(ours_one)
        ours = lambda: [ours_one() for _ in range(args.steps)]  # noqa: E731
        theirs = lambda: [theirs_one() for _ in range(args.steps)]  # noqa: E731
        rates = alternating_rates(ours, theirs, args.steps, args.repeats)
        rows_per_step = args.batch * (2 if objective == "unsup" else 3)
        row = {"objective": objective, "dtype": dtype, "reference_dtype": "float32",
               "jaxsim_steps_per_s": rates["ours_per_s"],
               "pytorch_steps_per_s": rates["reference_per_s"],
               "jaxsim_sentences_per_s": rates["ours_per_s"] * rows_per_step,
               "pytorch_sentences_per_s": rates["reference_per_s"] * rows_per_step,
               "ratio": rates["ratio"], "ratio_min": rates["ratio_min"],
               "ratio_max": rates["ratio_max"], "repeats": rates["repeats"],
               "compile_s": round(max(first - warm, 0.0), 2)}
        rss = ""
        if memory:
            row["jaxsim_memory"] = memory[("jaxsim", objective, dtype)]
            row["pytorch_memory"] = memory[("torch", objective, "float32")]
            rss = (f"  peak RSS jaxsim {row['jaxsim_memory']['peak_rss_mb']:.0f} MB, "
                   f"PyTorch {row['pytorch_memory']['peak_rss_mb']:.0f} MB")
        record["rows"][f"{objective}:{dtype}"] = row
        print(f"{objective:5s} {dtype:8s}  jaxsim {row['jaxsim_steps_per_s']:.3f} steps/s  "
              f"PyTorch fp32 {row['pytorch_steps_per_s']:.3f} steps/s  ratio {row['ratio']:.2f}x "
              f"(min {row['ratio_min']:.2f}, max {row['ratio_max']:.2f})  compile "
              f"{row['compile_s']:.1f} s{rss}", flush=True)
    headline = record["rows"].get("unsup:float32") or next(iter(record["rows"].values()))
    record["ratio"] = headline["ratio"]
    record["ratio_row"] = f"{headline['objective']}:{headline['dtype']}"
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_json(args.json, record)


def measure_memory(rows, args) -> dict:
    """{(side, objective, dtype): memory figures}, each side in its own subprocess."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_path = str(bundled_model_path())
        for objective in sorted({o for o, _ in rows}):
            np.savez(folder / f"{objective}.npz", **tokenized(objective, args.batch,
                                                              args.max_len))
            cmd = [sys.executable, str(HERE / "torch_reference.py"), "--arrays",
                   str(folder / f"{objective}.npz"), "--model", model_path,
                   "--threads", str(args.threads)]
            out[("torch", objective, "float32")] = _child(cmd)
        for objective, dtype in rows:
            cmd = [sys.executable, __file__, "--rss-child", f"{objective}:{dtype}", str(folder),
                   "--threads", str(args.threads)]
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
