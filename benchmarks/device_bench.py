"""SimCSE train steps on an accelerator: steps/s, achieved TFLOP/s and MFU, with PyTorch beside.

A BERT-base-shaped encoder (hidden 768, 12 layers, 12 heads, intermediate 3072, vocab 30522;
random init, nothing downloaded) in the paper's two settings, length 32, dropout 0.1, mean
pooling, cosine / 0.05 InfoNCE, clipping 1.0, AdamW:

  unsup   batch 64 sentences, each encoded twice (two dropout views)
  sup     batch 512 (premise, entailment, contradiction) triplets

jaxsim runs `jaxsim.train.step.make_train_step` (as `train.py` builds it). FLOPs per step are
XLA's count for the compiled step (`compiled.cost_analysis()['flops']`; the lowered module's
count where a backend reports none); achieved TFLOP/s = FLOPs x steps/s, MFU = achieved / the
device's data-sheet peak for the compute dtype (table below, or `--peak-tflops`);
`fraction_of_peak` = achieved / the matrix-product peak measured on the device in the same run
(`peak.py`: JAX's for jaxsim, torch's for PyTorch). The PyTorch reference (`torch_reference.py`:
transformers BertModel + the same loss + AdamW) runs on the same device in the same run where
torch has that device (CUDA, or the CPU), twice: in float32 and under
`torch.autocast(device, dtype=torch.bfloat16)` (float32 master weights); its TFLOP/s use the same
per-step count. The three run in turn `--repeats` rounds of `--steps` steps; each ratio is the
median [min, max] of per-round ratios jaxsim steps/s / PyTorch steps/s (`vs_pytorch_float32`,
`vs_pytorch_bfloat16`); a setting's `ratio` is against the PyTorch of jaxsim's compute dtype.

float32 means float32 products on both sides (`--fp32-matmul tf32` allows TF32 on both, with the
TF32 peak). `--tiny` swaps in a tiny model and batches so the script runs on a CPU in seconds
(its test runs it that way).

    python benchmarks/device_bench.py [--dtype bfloat16] [--steps 10] [--json out.json]
    python benchmarks/device_bench.py --tiny --dtype float32 --json /tmp/tiny.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxsim import sharding

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_reference  # noqa: E402
from common import alternating, ratio_stats, setup_process, write_json, xla_flops  # noqa: E402
from peak import describe, fraction_of_peak, measure_peaks  # noqa: E402
from train_speed import build_step  # noqa: E402

BERT_BASE = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072,
             "max_position_embeddings": 512, "type_vocab_size": 2}
TINY = {"vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 37, "max_position_embeddings": 64, "type_vocab_size": 2}
# setting -> (objective, examples per step, sentences per example in the batch arrays)
SETTINGS = {"unsup": ("unsup", 64, 1), "sup": ("sup", 512, 3)}
# PyTorch's configurations: float32, and bf16 autocast (float32 master weights).
REFERENCES = ("float32", "bfloat16")
TINY_BATCH = {"unsup": 8, "sup": 8}
LENGTH, TINY_LENGTH = 32, 16

# Dense peak TFLOP/s by device kind (first matching substring): (bf16, fp32, tf32).
# NVIDIA: SXM data-sheet figures without sparsity; TPU: per chip. None: not published/used.
PEAKS = (
    ("H200", 989.4, 66.9, 494.7),
    ("H100", 989.4, 66.9, 494.7),
    ("A100", 312.0, 19.5, 156.0),
    ("L40S", 362.1, 91.6, 181.0),
    ("L4", 121.0, 30.3, 60.0),
    ("A10", 125.0, 31.2, 62.5),
    ("V100", None, 15.7, None),
    ("T4", None, 8.1, None),
    ("TPU v6", 918.0, None, None),
    ("TPU v5p", 459.0, None, None),
    ("TPU v5 lite", 197.0, None, None),
    ("TPU v5e", 197.0, None, None),
    ("TPU v4", 275.0, None, None),
)


def peak_tflops(device_kind: str, dtype: str, fp32_matmul: str) -> float | None:
    for pattern, bf16, fp32, tf32 in PEAKS:
        if pattern.lower() in device_kind.lower():
            if dtype == "bfloat16":
                return bf16
            return tf32 if fp32_matmul == "tf32" else fp32
    return None


def random_batch(rng: np.random.Generator, batch: int, views: int, length: int,
                 vocab: int) -> dict:
    """int32 [batch, views, length] ids with random lengths (>= length / 4) and their masks."""
    ids = rng.integers(5, vocab, size=(batch, views, length)).astype(np.int32)
    lengths = rng.integers(max(2, length // 4), length + 1, size=(batch, views, 1))
    mask = (np.arange(length)[None, None] < lengths).astype(np.int32)
    return {"input_ids": ids * mask, "attention_mask": mask,
            "token_type_ids": np.zeros_like(ids)}


def jaxsim_step(objective: str, dtype: str, arrays: dict, arch: dict, fast_compile: bool,
                pack_length: int = 0):
    """(run one step, FLOPs per step, FLOPs source, compile seconds); `pack_length` > 0: the
    batch's sentences packed into rows of that many tokens (TrainConfig.pack_length)."""
    train_step, state, placed = build_step(
        objective, dtype, arrays, mesh=sharding.make_mesh(devices=jax.devices()[:1]),
        random_init=True, model_overrides=arch, fast_compile=fast_compile,
        pack_length=pack_length)
    start = time.perf_counter()
    lowered = train_step.lower(state, placed)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    flops, source = xla_flops(compiled), "compiled"
    if not flops:
        flops, source = xla_flops(lowered), "lowered"
    holder = {"state": state}

    def run():
        holder["state"], metrics = compiled(holder["state"], placed)
        jax.block_until_ready(metrics["loss"])

    return run, flops, source, compile_s


def torch_device() -> str | None:
    """torch's device matching JAX's backend, or None when torch lacks it."""
    try:
        import torch
    except ImportError:
        return None
    backend = jax.default_backend()
    if backend == "cpu":
        return "cpu"
    if backend in ("gpu", "cuda") and torch.cuda.is_available():
        return "cuda"
    return None


def measure_setting(name: str, arrays: dict, arch: dict, peak: float | None, peaks: dict,
                    tdev: str | None, args) -> dict:
    """One setting: jaxsim and the PyTorch configurations in alternating rounds."""
    objective, _, _ = SETTINGS[name]
    run, flops, source, compile_s = jaxsim_step(objective, args.dtype, arrays, arch,
                                                fast_compile=args.tiny)
    ones = {"jaxsim": run}
    if args.pack_length:
        ones["jaxsim_packed"], packed_flops, _, _ = jaxsim_step(
            objective, args.dtype, arrays, arch, fast_compile=args.tiny,
            pack_length=args.pack_length)
    if tdev is not None:
        for ref in REFERENCES:
            ones[f"pytorch_{ref}"] = _torch_run(objective, arrays, arch, args, tdev, ref)
    for one in ones.values():
        for _ in range(args.warmup):
            one()
    contenders = {k: (lambda one=one: [one() for _ in range(args.steps)])
                  for k, one in ones.items()}
    rates = alternating(contenders, args.steps, args.repeats)
    batch = arrays["input_ids"].shape[0]
    row = {"objective": objective, "batch": batch, "views": 2 if objective == "unsup" else 3,
           "flops_per_step": flops, "flops_source": source, "compile_s": round(compile_s, 2),
           "rates": {k: r["rates"] for k, r in rates.items()}}
    for key, r in rates.items():
        if key == "jaxsim_packed":
            continue  # below, against its own FLOP count
        dtype = args.dtype if key == "jaxsim" else key.split("_", 1)[1]
        row[f"{key}_steps_per_s"] = r["per_s"]
        row[f"{key}_tflops"] = flops * r["per_s"] / 1e12
        framework = "jax" if key == "jaxsim" else "torch"
        measured = peaks.get(framework, {}).get(dtype)
        fraction = fraction_of_peak(flops, r["per_s"], measured)
        if key == "jaxsim":
            row["peak_gflops"] = measured
            row["fraction_of_peak"] = fraction
            row["jaxsim_mfu"] = row["jaxsim_tflops"] / peak if peak else None
        else:
            row[f"{key}_fraction_of_peak"] = fraction
    if tdev is not None:
        for ref in REFERENCES:
            row[f"vs_pytorch_{ref}"] = ratio_stats(rates["jaxsim"]["rates"],
                                                   rates[f"pytorch_{ref}"]["rates"])
        row.update({k: row[f"vs_pytorch_{args.dtype}"][k]
                    for k in ("ratio", "ratio_min", "ratio_max")})
    if "jaxsim_packed" in rates:  # the same examples and loss, no padding computed
        per_s = rates["jaxsim_packed"]["per_s"]
        row.update(jaxsim_packed_steps_per_s=per_s, packed_flops_per_step=packed_flops,
                   packed_tflops=packed_flops * per_s / 1e12,
                   packed_fraction_of_peak=fraction_of_peak(packed_flops, per_s,
                                                            row["peak_gflops"]))
        row["packed_mfu"] = row["packed_tflops"] / peak if peak else None
        for ref in REFERENCES if tdev is not None else ():
            row[f"packed_vs_pytorch_{ref}"] = ratio_stats(rates["jaxsim_packed"]["rates"],
                                                          rates[f"pytorch_{ref}"]["rates"])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default="unsup,sup", help="unsup, sup or both")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--fp32-matmul", default="highest", choices=("highest", "tf32"),
                        help="float32 products: true float32, or TF32 on both sides")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-size", type=int, default=None,
                        help="measured peak's product size (default 8192 on accelerators, "
                             "2048 on the CPU)")
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak for the dtype (overrides the table)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--pack-length", type=int, default=None,
                        help="also time jaxsim on the batch packed into rows of this many tokens "
                             "(TrainConfig.pack_length; default the length; 0: padded only)")
    parser.add_argument("--tiny", action="store_true", help="tiny model and batches (CPU test)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setup_process()
    settings = [s for s in args.settings.split(",") if s]
    for s in settings:
        if s not in SETTINGS:
            parser.error(f"unknown setting {s!r}; known: {', '.join(SETTINGS)}")
    if args.dtype == "float32":
        jax.config.update("jax_default_matmul_precision",
                          "tensorfloat32" if args.fp32_matmul == "tf32" else "highest")
    device = jax.devices()[0]
    kind = device.device_kind
    peak = args.peak_tflops or peak_tflops(kind, args.dtype, args.fp32_matmul)
    arch = TINY if args.tiny else BERT_BASE
    length = TINY_LENGTH if args.tiny else LENGTH
    if args.pack_length is None:
        args.pack_length = length
    tdev = None if args.no_torch else torch_device()
    if tdev == "cpu":
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count())))
    peak_size = args.peak_size or (2048 if device.platform == "cpu" else 8192)
    peaks = measure_peaks(peak_size, args.peak_repeats, torch_too=tdev is not None)
    print(describe(peaks), flush=True)
    record = {"device_kind": kind, "platform": device.platform, "dtype": args.dtype,
              "fp32_matmul": args.fp32_matmul if args.dtype == "float32" else None,
              "peak_tflops": peak, "peak_source": "--peak-tflops" if args.peak_tflops else
              ("table" if peak else None), "peak_gflops": peaks,
              "model": "tiny" if args.tiny else "bert-base", "architecture": arch,
              "length": length, "steps": args.steps, "repeats": args.repeats,
              "warmup": args.warmup, "torch_device": tdev, "settings": {}}
    rng = np.random.default_rng(0)
    for name in settings:
        objective, batch, views = SETTINGS[name]
        batch = TINY_BATCH[name] if args.tiny else batch
        arrays = random_batch(rng, batch, views, length, arch["vocab_size"])
        row = measure_setting(name, arrays, arch, peak, peaks, tdev, args)
        record["settings"][name] = row
        mfu = f"  MFU {row['jaxsim_mfu']:.1%}" if peak else "  (no data-sheet peak: --peak-tflops)"
        line = (f"{name:5s} batch {batch:4d}  jaxsim {row['jaxsim_steps_per_s']:8.3f} steps/s "
                f"{row['jaxsim_tflops']:8.3f} TFLOP/s{mfu}, {row['fraction_of_peak']:.1%} of "
                f"measured peak")
        for ref in REFERENCES if tdev is not None else ():
            stats = row[f"vs_pytorch_{ref}"]
            line += (f"\n      PyTorch ({tdev}, {ref}{' autocast' if ref == 'bfloat16' else ''}) "
                     f"{row[f'pytorch_{ref}_steps_per_s']:8.3f} steps/s  ratio "
                     f"{stats['ratio']:.2f}x [{stats['ratio_min']:.2f}-{stats['ratio_max']:.2f}]")
        if "jaxsim_packed_steps_per_s" in row:
            line += (f"\n      packed: jaxsim {row['jaxsim_packed_steps_per_s']:8.3f} steps/s "
                     f"{row['packed_tflops']:8.3f} TFLOP/s" + "".join(
                         f", vs PyTorch {ref} {row[f'packed_vs_pytorch_{ref}']['ratio']:.2f}x"
                         for ref in REFERENCES if f"packed_vs_pytorch_{ref}" in row))
        print(line, flush=True)
    first = record["settings"][settings[0]]
    record["ratio"] = first.get("ratio")  # None where no PyTorch ran on this device
    record["ratio_setting"] = settings[0]
    write_json(args.json, record)


def _torch_run(objective: str, arrays: dict, arch: dict, args, device: str, reference: str):
    import torch

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.fp32_matmul == "tf32"
        torch.backends.cudnn.allow_tf32 = args.fp32_matmul == "tf32"
    model = torch_reference.load_model(config=arch)
    autocast = torch.bfloat16 if reference == "bfloat16" else None
    return torch_reference.make_step(model, arrays, unsup=objective == "unsup", device=device,
                                     autocast_dtype=autocast)


if __name__ == "__main__":
    main()
