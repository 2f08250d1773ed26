"""Command line `python -m jaxsim analyze`: BERT-flow's frequency analysis of a model's token
embeddings (the analysis: `jaxsim.analysis`).

    python -m jaxsim analyze --corpus sentences.txt --out DIR [--model M] [--k 3]
        [--post whitening --post flow ...] [--tb DIR]

Writes DIR/frequency.json (the table, per rank bucket: tokens, mean L2 norm, mean distance to
the k nearest neighbours; the sentence vectors' anisotropy and spectrum; the same after each
--post calibration, fitted on the corpus's sentence vectors as eval.py fits it and applied to
the token embeddings, see `jaxsim.analysis.frequency_post`), DIR/frequency.png and
DIR/spectrum.png, and prints the tables.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from jaxsim import calibrate
from jaxsim.analysis import frequency_post
from jaxsim.analysis.frequency import PAPER_BUCKETS, plot_frequency
from jaxsim.cli import cli_io
from jaxsim.data.readers import read_sentences
from jaxsim.formats.pretrained import bundled_model_path, load_pretrained
from jaxsim.storage import store

JSON_FILE, PNG_FILE, SPECTRUM_FILE = "frequency.json", "frequency.png", "spectrum.png"


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
    p.add_argument("--post", action="append", default=[],
                   help="calibration as eval.py names them (whitening[:K], sn, natsv:K, "
                        "flow[:CONFIG]), fitted on the corpus's sentence vectors and applied "
                        "to the token embeddings; repeat for several")
    p.add_argument("--tb", default=None,
                   help="TensorBoard folder: flow fits write their NLL curves to TB/<post>")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier analysis")
    return cli_io.add_import_flag(p)


def analyze_main(argv: Sequence[str]) -> int:
    args = analyze_parser().parse_args(argv)
    try:
        buckets = [int(b) for b in args.buckets.split(",")]
    except ValueError:
        raise cli_io.UsageError(f"--buckets must be comma-separated integers, got "
                                f"{args.buckets!r}") from None
    if buckets != sorted(set(buckets)) or len(buckets) < 2 or buckets[0] < 0:
        raise cli_io.UsageError(f"--buckets must be at least two increasing ranks >= 0, got "
                                f"{args.buckets!r}")
    if args.k < 1:
        raise cli_io.UsageError(f"--k must be positive, got {args.k}")
    for post in args.post:
        calibrate.parse_spec(post)  # a bad spec fails now, in one line
    if args.tb is not None and store.is_remote(args.tb):
        raise cli_io.UsageError(f"--tb must be a local folder, got {args.tb}")
    for name in (JSON_FILE, PNG_FILE, SPECTRUM_FILE):
        store.refuse_existing(args.out / name, args.overwrite, "--out")
    sentences = read_sentences(args.corpus)
    unique = list(dict.fromkeys(sentences))
    if len(unique) < 2:
        raise cli_io.UsageError(f"--corpus {args.corpus}: needs at least 2 distinct sentences")
    model = load_pretrained(args.model or bundled_model_path())
    result = frequency_post.analyze_model(model, sentences, unique, args.post, buckets, args.k,
                                          args.tb)
    result["corpus"] = str(args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    store.write_json(args.out / JSON_FILE, result)
    plot_frequency(result, args.out / PNG_FILE)
    frequency_post.plot_spectra(result, args.out / SPECTRUM_FILE)
    print(f"{result['tokens_ranked']} distinct word pieces ({result['tokens_counted']} counted) "
          f"in {len(sentences)} sentences of {args.corpus}")
    for name, state in [("raw", result)] + [(c["post"], c) for c in result["calibrations"]]:
        print(f"\n{name}" + (f": {state['calibration']}" if name != "raw" else ""))
        if state.get("note"):
            print(f"note: {state['note']}")
        print(f"{'rank':>12} {'tokens':>7} {'mean norm':>10} {f'{args.k}-NN dist':>10}")
        for b in state["buckets"]:
            print(f"{b['lo']:>5}-{b['hi']:<6} {b['tokens']:>7} {b['mean_norm']:>10.4f} "
                  f"{b['mean_knn_distance']:>10.4f}")
        d = state["sentence_diagnostics"]
        print(f"sentences: anisotropy {d['anisotropy']:.4f}, effective rank "
              f"{d['effective_rank']:.1f} of {d['dim']}, top-1 energy {d['top1_energy']:.3f}")
    print(f"\nwrote {args.out / JSON_FILE}, {args.out / PNG_FILE} and {args.out / SPECTRUM_FILE}")
    return 0
