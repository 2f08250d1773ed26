"""Command line `python -m jaxsim analyze`: BERT-flow's frequency analysis of a model's token
embeddings (see `jaxsim.eval.frequency`).

    python -m jaxsim analyze --corpus sentences.txt --out DIR [--model M] [--k 3]

Writes DIR/frequency.json (the table, per rank bucket: tokens, mean L2 norm, mean distance to
the k nearest neighbours) and DIR/frequency.png, and prints the table.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Sequence

from jaxsim.data.readers import read_sentences
from jaxsim.errors import JaxsimError
from jaxsim.eval.frequency import PAPER_BUCKETS, analyze, plot_frequency
from jaxsim.io import store
from jaxsim.io.pretrained import bundled_model_path, load_pretrained

JSON_FILE, PNG_FILE = "frequency.json", "frequency.png"


class AnalyzeUsageError(JaxsimError):
    """A bad analyze option."""


def analyze_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsim analyze",
        description="Token embeddings' L2 norm and k-NN distance by word-piece frequency rank "
                    "(BERT-flow, Table 1), frequencies counted on --corpus.")
    p.add_argument("--model", default=None, help="HF folder, hub id or train workdir "
                                                 "(default: bundled all-MiniLM-L6-v2)")
    p.add_argument("--corpus", required=True, type=Path,
                   help="sentences to count word pieces on, one a line")
    p.add_argument("--out", required=True, type=Path, help="folder for the JSON and PNG")
    p.add_argument("--k", type=int, default=3, help="nearest neighbours per token")
    p.add_argument("--buckets", default=",".join(map(str, PAPER_BUCKETS)),
                   help="rank boundaries (the paper's by default)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier analysis")
    return p


def analyze_main(argv: Sequence[str]) -> int:
    args = analyze_parser().parse_args(argv)
    try:
        buckets = [int(b) for b in args.buckets.split(",")]
    except ValueError:
        raise AnalyzeUsageError(f"--buckets must be comma-separated integers, got "
                                f"{args.buckets!r}") from None
    if buckets != sorted(set(buckets)) or len(buckets) < 2 or buckets[0] < 0:
        raise AnalyzeUsageError(f"--buckets must be at least two increasing ranks >= 0, got "
                                f"{args.buckets!r}")
    if args.k < 1:
        raise AnalyzeUsageError(f"--k must be positive, got {args.k}")
    for name in (JSON_FILE, PNG_FILE):
        store.refuse_existing(args.out / name, args.overwrite, "--out")
    sentences = read_sentences(args.corpus)
    model = load_pretrained(args.model or bundled_model_path())
    result = analyze(model, sentences, buckets=buckets, k=args.k)
    args.out.mkdir(parents=True, exist_ok=True)
    store.write_json(args.out / JSON_FILE, _finite(result))
    plot_frequency(result, args.out / PNG_FILE)
    print(f"{result['tokens_ranked']} distinct word pieces ({result['tokens_counted']} counted) "
          f"in {len(sentences)} sentences of {args.corpus}")
    print(f"{'rank':>12} {'tokens':>7} {'mean norm':>10} {f'{args.k}-NN dist':>10}")
    for b in result["buckets"]:
        print(f"{b['lo']:>5}-{b['hi']:<6} {b['tokens']:>7} {b['mean_norm']:>10.4f} "
              f"{b['mean_knn_distance']:>10.4f}")
    print(f"wrote {args.out / JSON_FILE} and {args.out / PNG_FILE}")
    return 0


def _finite(result: dict) -> dict:
    """Empty buckets have no means: null in JSON."""
    return {**result, "buckets": [{k: (None if isinstance(v, float) and not math.isfinite(v)
                                       else v) for k, v in b.items()}
                                  for b in result["buckets"]]}
