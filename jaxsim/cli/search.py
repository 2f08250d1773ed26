"""Command lines `python -m jaxsim index` and `python -m jaxsim search`.

    python -m jaxsim index --model M --input corpus.txt --out DIR [--overwrite]
    python -m jaxsim search --index DIR --query "A man plays guitar." [--top-k 5 --threshold 0.6]
    python -m jaxsim search --index DIR --queries queries.txt

`search` prints one result a line, `score<TAB>sentence`, best first (with a `query: ...` line
before each group when several --query are given). Bad input is one `error: ...` line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from jaxsim.cli import cli_io
from jaxsim.formats.hf_folder import ModelLoadError
from jaxsim.formats.pretrained import bundled_model_path, load_pretrained
from jaxsim.search.ann import METHODS
from jaxsim.search.index import build_index, load_index
from jaxsim.search.storage import check_replaceable_index
from jaxsim.search.vectors import SearchError, sentence_list


def _one_line(text: str) -> str:
    """A sentence printable on one output line (line breaks and tabs escaped)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def index_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxsim index",
        description="Encode a corpus (one sentence a line) into a search index folder.")
    parser.add_argument("--model", default=None, help="HF folder, hub id or train workdir "
                                                       "(default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--input", required=True,
                        help="corpus, one sentence a line; - reads standard input")
    cli_io.add_output_flags(parser, "--out", "index folder to write (absent or empty; an "
                            "existing index only with --overwrite)",
                            overwrite_help="replace an existing index in --out", required=True)
    parser.add_argument("--pooler", default=None, help="pooler (default: the model's own)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--method", choices=METHODS, default="exact",
                        help="exact (default; sharded device search) or approximate through "
                             "faiss: ivf | hnsw (pip install 'jaxsim[ann]')")
    return cli_io.add_import_flag(parser)


def index_main(argv: Sequence[str]) -> int:
    args = index_parser().parse_args(argv)
    # Cheap checks first: the input, then the output, before the model loads.
    sentences, skipped, name = cli_io.input_sentences(args.input)
    cli_io.check_output_dir(args.out, args.overwrite, "--out", keep=check_replaceable_index)
    if skipped:
        print(f"note: {name}: skipped {skipped} blank line{'s' * (skipped > 1)}; row i of the "
              f"index is the i-th non-blank line", file=sys.stderr)
    model = load_pretrained(args.model or bundled_model_path())
    cli_io.warn_truncated(model.tokenizer, sentences, model.max_length(), name)
    index = build_index(model, sentences, pooler=args.pooler, batch_size=args.batch_size,
                        method=args.method)
    index.save(args.out, overwrite=args.overwrite, what="--out")
    print(f"indexed {len(index)} sentences (dimension {index.dim}, pooler {index.info.pooler}) "
          f"into {args.out}", file=sys.stderr)
    return 0


def search_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxsim search",
        description="Print the indexed sentences most similar to each query, with cosines.")
    parser.add_argument("--index", required=True, type=Path, help="folder from `jaxsim index`")
    parser.add_argument("--query", action="append", default=[],
                        help="query sentence (repeat for several)")
    parser.add_argument("--queries", default=None,
                        help="a file of queries, one a line (blank lines skipped); - reads "
                             "standard input")
    # The defaults of SimCSE's tool (`SimCSE.search`), whose meaning these flags keep.
    parser.add_argument("--top-k", type=int, default=5,
                        help="at most this many per query (default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.6,
                        help="keep cosines >= this (default: %(default)s; -1 keeps all)")
    parser.add_argument("--model", default=None,
                        help="model to encode queries with (default: the index's; checked)")
    parser.add_argument("--batch-size", type=int, default=64)
    return cli_io.add_import_flag(parser)


def search_main(argv: Sequence[str]) -> int:
    args = search_parser().parse_args(argv)
    queries = list(args.query)
    if args.queries is not None:
        queries += cli_io.input_sentences(args.queries)[0]
    if not queries:
        raise SearchError("no query: pass --query TEXT (repeatable) or --queries FILE")
    if not -1 <= args.threshold <= 1:  # a cosine: above 1 keeps nothing, below -1 is -1
        raise SearchError(f"--threshold must be in [-1, 1] (a cosine), got {args.threshold}")
    sentence_list(queries, "queries", allow_blank=False)  # before the index and model load
    index = load_index(args.index)  # a bad folder fails before a model is loaded
    model_path = args.model or index.info.model
    if model_path is None:
        raise SearchError(f"{args.index}: the index records no model (built from bare "
                          f"vectors): pass --model")
    try:
        model = load_pretrained(model_path)
    except ModelLoadError as e:
        if args.model is not None:
            raise
        # A model folder moved or deleted since indexing: say where the path came from.
        raise ModelLoadError(f"{e} (the model the index records; pass --model to encode "
                             f"the queries with that model from elsewhere)") from None
    results = index.search(model, queries, threshold=args.threshold, top_k=args.top_k,
                           batch_size=args.batch_size)
    cli_io.warn_truncated(model.tokenizer, queries, model.max_length(), "queries")
    for query, hits in zip(queries, results):
        if len(queries) > 1:
            print(f"query: {_one_line(query)}")
        for sentence, score in hits:
            print(f"{score:.4f}\t{_one_line(sentence)}")
        if not hits:  # on stderr: stdout holds only result lines
            which = f" for {_one_line(query)!r}" if len(queries) > 1 else ""
            print(f"no result{which}: no cosine reaches --threshold {args.threshold:g} "
                  f"(--threshold -1 keeps every hit)", file=sys.stderr, flush=True)
    return 0
