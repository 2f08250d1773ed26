"""Encoding throughput: jaxsim vs sentence-transformers, same model, same threads, one process.

Two sentence sets: the unique STS-B test sentences (short, 8-30 tokens) and a long set of
64-128-token texts (consecutive MR review sentences joined). Four contenders run in turn
`--repeats` times on each set: jaxsim in float32 and in bf16 compute, sentence-transformers in
float32 and under `torch.autocast('cpu', dtype=torch.bfloat16)` (the configuration a PyTorch
user picks for speed on a CPU with bf16 instructions). Every jaxsim/ST pair gets a ratio: the
median [min, max] of the per-round ratios of sentences/s (`ratios["bfloat16_vs_st_float32"]`,
...). Each set's `best_vs_best`, and the record's headline `ratio` (on the first set), pair each
side's fastest configuration: bf16 and bf16 autocast on a CPU with bf16 instructions, float32
where bf16 is emulated (autocast then runs slower than float32). jaxsim's compile time (first
pass over every length bucket) is measured apart.

Fraction of peak: FLOPs of a pass are XLA's cost analysis of the compiled encode program, summed
over the batches `jaxsim.encode` makes (one compile per length bucket); achieved GFLOP/s over the
matrix-product peak of the dtype (`peak.py`, measured in this process on the same threads).

`--shape bert-base` / `tiny` encode with a random-init model of that shape (saved once as a
sentence-transformers folder both sides load); `--limit N` keeps N texts of each set, `--sets`
chooses the sets.

`--compare-forms` adds jaxsim in the layers' plain form (`kernels='xla'`, what TPU and GPU run)
beside the CPU forms that `kernels='auto'` picks on a CPU (`jaxsim.models.kernels`), in the
same alternating rounds: `ratios["bfloat16_cpu_vs_xla_forms"]` is the case for keeping them.

    python benchmarks/encode_speed.py [--threads 2] [--repeats 5] [--shape minilm]
        [--compare-forms] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SHAPES,
    alternating,
    available_cpus,
    best_vs_best,
    load_average,
    ratio_stats,
    seconds,
    set_threads,
    setup_process,
    write_json,
    xla_flops,
)
from peak import describe, fraction_of_peak, measure_peaks  # noqa: E402

DTYPES = ("float32", "bfloat16")
SETS = ("stsb_test", "long_64_128")


def stsb_test_sentences(root: Path) -> list[str]:
    from jaxsim.data.senteval import load_stsb

    pairs = load_stsb(root, "test")
    return list(dict.fromkeys(s for pair in zip(pairs.sent1, pairs.sent2) for s in pair))


def long_texts(root: Path, tokenizer, count: int = 1024) -> list[str]:
    """Consecutive MR sentences joined until each text has 64-128 tokens."""
    from jaxsim.data.readers import read_sentences

    lines = [s for s in read_sentences(root / "MR" / "rt-polarity.pos") if s]
    texts, current = [], []
    for line in lines:
        current.append(line)
        n = len(tokenizer(" ".join(current))["input_ids"])
        if n >= 64:
            if n <= 128:
                texts.append(" ".join(current))
            current = []
        if len(texts) == count:
            break
    return texts


def random_model_folder(shape: str, folder: Path) -> Path:
    """A sentence-transformers folder (BERT at `shape`, random init, seed 0, the bundled
    tokenizer, mean pooling, Normalize), as both sides load it."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    from jaxsim.formats.hf_folder import bundled_model_path

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    hf = folder / "hf"
    BertModel(BertConfig(**SHAPES[shape])).save_pretrained(hf)
    AutoTokenizer.from_pretrained(str(bundled_model_path())).save_pretrained(hf)
    pooling = Pooling(SHAPES[shape]["hidden_size"], "mean")
    st = SentenceTransformer(modules=[Transformer(str(hf), max_seq_length=256), pooling,
                                      Normalize()], device="cpu")
    st.save(str(folder / "st"))
    return folder / "st"


def batches_by_shape(model, sentences: list[str], batch_size: int) -> tuple:
    """(mesh, {token shape: [batches]}): the batches `jaxsim.encode` itself makes of
    `sentences`, grouped by the program each compiles."""
    from jaxsim import sharding
    from jaxsim.data.encode_layout import token_budget
    from jaxsim.encode import _batches, default_mesh

    mesh = default_mesh()
    shards = sharding.batch_shards(mesh)
    groups = collections.defaultdict(list)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        for _, batch in _batches(model, sentences, batch_size, model.max_length(), executor,
                                 shards, token_budget(mesh, shards)):
            groups[batch.tokens.input_ids.shape].append(batch)
    return mesh, groups


def pass_flops(model, sentences: list[str], batch_size: int, dtype: str) -> float:
    """XLA's FLOPs of one `jaxsim.encode(..., normalize=True)` pass over `sentences`: the
    compiled encode program's count for each batch shape, times the batches of that shape."""
    import jax
    import jax.numpy as jnp

    from jaxsim.data.tokenize import TokenBatch
    from jaxsim.encode import make_encode_fn

    # The batches jaxsim.encode itself makes, so the count matches the timed work.
    mesh, groups = batches_by_shape(model, sentences, batch_size)
    params = jax.tree.map(lambda p: jnp.asarray(p, dtype), model.params)
    fn = make_encode_fn(model.encoder.clone(dtype=jnp.dtype(dtype)), True, False, mesh)
    total = 0.0
    for tokens, batches in groups.items():
        batch = TokenBatch(*(jax.ShapeDtypeStruct(tokens, jnp.int32),) * 3)
        total += len(batches) * xla_flops(fn.lower(params, batch, jax.random.key(0)).compile())
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for both sides (the process is pinned to them)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shape", default="minilm", choices=("minilm", *SHAPES),
                        help="minilm: the bundled all-MiniLM-L6-v2; bert-base / tiny: random "
                             "init at those shapes")
    parser.add_argument("--limit", type=int, default=None, help="texts kept from each set")
    parser.add_argument("--sets", default=",".join(SETS),
                        help=f"comma-separated sentence sets (default {','.join(SETS)})")
    parser.add_argument("--peak-size", type=int, default=2048, help="peak product size")
    parser.add_argument("--peak-repeats", type=int, default=10)
    parser.add_argument("--data", type=Path, default=None, help="SentEval root")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--compare-forms", action="store_true",
                        help="also run jaxsim with the layers' plain (TPU/GPU) form")
    args = parser.parse_args()
    setup_process()
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be positive")
    args.sets = [name for name in args.sets.split(",") if name]
    unknown = sorted(set(args.sets) - set(SETS))
    if unknown or not args.sets:
        parser.error(f"--sets: unknown {', '.join(unknown) or '(none given)'}; known: "
                     f"{', '.join(SETS)}")
    set_threads(args.threads)

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run(args, Path(tmp), torch)


def run(args, tmp: Path, torch) -> None:
    import jax.numpy as jnp
    import numpy as np
    from sentence_transformers import SentenceTransformer

    import jaxsim
    from jaxsim.storage.paths import SENTEVAL_ROOT

    load = load_average()
    print(f"threads {args.threads}, shape {args.shape}, batch {args.batch_size}, 1-min load "
          f"average before the run {'n/a' if load is None else f'{load:.2f}'}", flush=True)
    peaks = measure_peaks(args.peak_size, args.peak_repeats)
    print(describe(peaks), flush=True)
    root = args.data or SENTEVAL_ROOT
    folder = (jaxsim.bundled_model_path() if args.shape == "minilm"
              else random_model_folder(args.shape, tmp))
    model = jaxsim.load_pretrained(folder)
    st = SentenceTransformer(str(folder), device="cpu")
    readers = {"stsb_test": lambda: stsb_test_sentences(root),
               "long_64_128": lambda: long_texts(root, model.tokenizer)}
    sets = {name: readers[name]()[: args.limit] for name in args.sets}
    record = {"threads": args.threads, "batch_size": args.batch_size, "shape": args.shape,
              "peak_gflops": peaks, "sets": {}}

    # The plain form of the layers, to weigh the CPU forms that 'auto' picks here against.
    plain = dataclasses.replace(model, encoder=model.encoder.clone(kernels="xla"))

    def ours(texts, dtype, which=model):
        return lambda: jaxsim.encode(which, texts, batch_size=args.batch_size, normalize=True,
                                     dtype=jnp.dtype(dtype))

    def theirs(texts, dtype):
        def call():
            # The bundled sentence-transformers pipeline ends in Normalize, as jaxsim's call.
            with (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
                  else contextlib.nullcontext()):
                return st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
        return call

    for name, texts in sets.items():
        n = len(texts)
        contenders = {}
        for dtype in DTYPES:
            contenders[f"jaxsim_{dtype}"] = ours(texts, dtype)
            contenders[f"st_{dtype}"] = theirs(texts, dtype)
            if args.compare_forms:
                contenders[f"jaxsim_{dtype}_xla_forms"] = ours(texts, dtype, plain)
        first = seconds(contenders["jaxsim_float32"])
        warm = seconds(contenders["jaxsim_float32"])
        for key in contenders:  # every program compiled before the rounds
            if key not in ("jaxsim_float32", "st_float32"):
                seconds(contenders[key])
        diff = float(np.abs(contenders["jaxsim_float32"]() - contenders["st_float32"]()).max())
        rates = alternating(contenders, n, args.repeats)
        entry = {"texts": n, "compile_s": max(first - warm, 0.0), "max_abs_diff": diff,
                 "rates": {k: r["rates"] for k, r in rates.items()}, "ratios": {},
                 "best_vs_best": best_vs_best(rates, [f"jaxsim_{d}" for d in DTYPES],
                                              [f"st_{d}" for d in DTYPES])}
        for key, r in rates.items():
            entry[f"{key}_per_s"] = r["per_s"]
        for dtype in DTYPES:
            flops = pass_flops(model, texts, args.batch_size, dtype)
            entry[f"jaxsim_{dtype}_flops_per_pass"] = flops
            entry[f"jaxsim_{dtype}_peak_gflops"] = peaks["jax"][dtype]
            entry[f"jaxsim_{dtype}_fraction_of_peak"] = fraction_of_peak(
                flops, entry[f"jaxsim_{dtype}_per_s"] / n, peaks["jax"][dtype])
            entry[f"st_{dtype}_fraction_of_peak"] = fraction_of_peak(
                flops, entry[f"st_{dtype}_per_s"] / n, peaks["torch"][dtype])
            for ref in DTYPES:
                entry["ratios"][f"{dtype}_vs_st_{ref}"] = ratio_stats(
                    rates[f"jaxsim_{dtype}"]["rates"], rates[f"st_{ref}"]["rates"])
            if args.compare_forms:
                entry["ratios"][f"{dtype}_cpu_vs_xla_forms"] = ratio_stats(
                    rates[f"jaxsim_{dtype}"]["rates"], rates[f"jaxsim_{dtype}_xla_forms"]["rates"])
        record["sets"][name] = entry
        print(f"{name}: {n} texts, max |jaxsim - ST| {diff:.1e}, compile {first - warm:.1f} s")
        for dtype in DTYPES:
            line = (f"  jaxsim {dtype:8s} {entry[f'jaxsim_{dtype}_per_s']:7.1f}/s "
                    f"({entry[f'jaxsim_{dtype}_fraction_of_peak']:.0%} of peak)  ST {dtype} "
                    f"{'autocast ' if dtype == 'bfloat16' else ''}"
                    f"{entry[f'st_{dtype}_per_s']:7.1f}/s")
            for ref in DTYPES:
                stats = entry["ratios"][f"{dtype}_vs_st_{ref}"]
                line += (f"  vs ST {ref} {stats['ratio']:.2f}x [{stats['ratio_min']:.2f}-"
                         f"{stats['ratio_max']:.2f}]")
            print(line, flush=True)
            if args.compare_forms:
                stats = entry["ratios"][f"{dtype}_cpu_vs_xla_forms"]
                print(f"  jaxsim {dtype:8s} plain (xla) forms "
                      f"{entry[f'jaxsim_{dtype}_xla_forms_per_s']:7.1f}/s: the CPU forms "
                      f"{stats['ratio']:.2f}x [{stats['ratio_min']:.2f}-{stats['ratio_max']:.2f}]",
                      flush=True)
        best = entry["best_vs_best"]
        print(f"  each at its best: {best['ours']} vs {best['reference']} {best['ratio']:.2f}x "
              f"[{best['ratio_min']:.2f}-{best['ratio_max']:.2f}]", flush=True)
    # Headline: each side's fastest configuration on the first set (bf16 vs bf16 autocast on a
    # CPU with bf16 instructions; float32 on both sides where bf16 is emulated).
    first = args.sets[0]
    best = record["sets"][first]["best_vs_best"]
    record["ratio"] = best["ratio"]
    record["ratio_definition"] = (f"{first}: jaxsim's fastest configuration ({best['ours']}) "
                                  f"sentences/s / sentence-transformers' fastest "
                                  f"({best['reference']}) sentences/s (median of per-round "
                                  "ratios; st_bfloat16 is bf16 autocast)")
    write_json(args.json, record)


if __name__ == "__main__":
    main()
