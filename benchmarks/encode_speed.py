"""Encoding throughput: jaxsim vs sentence-transformers, same model, same threads, one process.

Two sentence sets: the unique STS-B test sentences (short, 8-30 tokens) and a long set of
64-128-token texts (consecutive MR review sentences joined). For each, the sides run alternately
`--repeats` times; the ratio's median, min and max are reported. jaxsim's compile time (first
pass over every length bucket) is measured apart. bf16 compute is reported as a second jaxsim row.

    python benchmarks/encode_speed.py [--threads 2] [--repeats 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (alternating_rates, available_cpus, seconds, set_threads,  # noqa: E402
                    write_json)


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=available_cpus(),
                        help="cores for both sides (the process is pinned to them)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data", type=Path, default=None, help="SentEval root")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    set_threads(args.threads)

    import jax.numpy as jnp
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    import jaxsim
    from jaxsim.paths import SENTEVAL_ROOT

    torch.set_num_threads(args.threads)
    root = args.data or SENTEVAL_ROOT
    model = jaxsim.load_pretrained("bundled")
    st = SentenceTransformer(str(jaxsim.bundled_model_path()), device="cpu")
    sets = {"stsb_test": stsb_test_sentences(root), "long_64_128": long_texts(root, model.tokenizer)}
    record = {"threads": args.threads, "batch_size": args.batch_size, "dtype": "float32",
              "sets": {}}
    for name, sentences in sets.items():
        n = len(sentences)
        # The bundled sentence-transformers pipeline ends in Normalize: normalize here too.
        ours = lambda: jaxsim.encode(model, sentences, batch_size=args.batch_size,  # noqa
                                     normalize=True)
        bf16 = lambda: jaxsim.encode(model, sentences, batch_size=args.batch_size,  # noqa
                                     normalize=True, dtype=jnp.bfloat16)
        theirs = lambda: st.encode(sentences, batch_size=args.batch_size,  # noqa
                                   convert_to_numpy=True)
        first = seconds(ours)
        warm = seconds(ours)
        seconds(bf16)
        diff = float(np.abs(ours() - theirs()).max())
        fp32 = alternating_rates(ours, theirs, n, args.repeats)
        half = alternating_rates(bf16, theirs, n, max(1, args.repeats // 2))
        record["sets"][name] = {"sentences": n, "fp32": fp32, "bf16": half,
                                "compile_s": max(first - warm, 0.0), "max_abs_diff": diff}
        print(f"{name}: {n} texts, max |jaxsim - ST| {diff:.1e}, compile {first - warm:.1f} s")
        print(f"  fp32 jaxsim {fp32['ours_per_s']:7.1f}/s  ST {fp32['reference_per_s']:7.1f}/s  "
              f"ratio median {fp32['ratio']:.2f}x (min {fp32['ratio_min']:.2f}, "
              f"max {fp32['ratio_max']:.2f}, {args.repeats} alternating repeats)")
        print(f"  bf16 jaxsim {half['ours_per_s']:7.1f}/s  ratio vs ST fp32 {half['ratio']:.2f}x")
    record["ratio"] = record["sets"]["stsb_test"]["fp32"]["ratio"]
    write_json(args.json, record)


if __name__ == "__main__":
    main()
