"""`python -m jaxsim encode`: sentences (one a line) -> a float32 .npy matrix, one row a sentence.

    python -m jaxsim encode --input sentences.txt --output vectors.npy [--model M]
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxsim import distributed
from jaxsim.cli import cli_io
from jaxsim.cli.cli_io import UsageError
from jaxsim.encode import encode
from jaxsim.formats.pretrained import bundled_model_path, load_pretrained
from jaxsim.models.poolers import POOLERS
from jaxsim.storage import store


def encode_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsim encode",
        description="Encode sentences (one a line) into a float32 .npy matrix, one row a "
                    "sentence. Blank lines are skipped (the same rule as every jaxsim command "
                    "reading sentence files): row i is the i-th non-blank line, and the "
                    "number skipped is reported.")
    p.add_argument("--model", default=None,
                   help="HF folder, hub id or train workdir (default: the bundled "
                        "all-MiniLM-L6-v2)")
    p.add_argument("--input", required=True,
                   help="UTF-8 text, one sentence a line; - reads standard input")
    cli_io.add_output_flags(p, "--output", "the .npy file to write (written under exactly this "
                            "name)", overwrite_help="replace an existing --output", required=True)
    p.add_argument("--pooler", choices=POOLERS, default=None,
                   help="default: the model's own")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="token limit, special tokens included (default: the model's); longer "
                        "sentences are truncated, with a warning")
    p.add_argument("--normalize", action="store_true", help="L2-normalize the vectors")
    distributed.add_launch_flags(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (the output is float32 either way)")
    return cli_io.add_import_flag(p)


def encode_main(argv: Sequence[str]) -> int:
    args = encode_parser().parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    output = cli_io.check_output_file(args.output, args.overwrite, "--output",
                                      inputs=[("--input", args.input), ("--model", args.model)])
    # Every process of a multi-process run encodes its devices' rows of each batch; the
    # vectors are gathered on all, and process 0 writes them.
    distributed.initialize_from_flags(args)
    sentences, skipped, name = cli_io.input_sentences(args.input)
    distributed.check_same_inputs({"sentences": sentences})
    if skipped:
        print(f"note: {name}: skipped {skipped} blank line{'s' * (skipped > 1)}; row i "
              f"of the output is the i-th non-blank line", file=sys.stderr)
    model = load_pretrained(bundled_model_path() if args.model is None else args.model,
                            pooler=args.pooler)
    limit = model.max_length() if args.max_length is None else args.max_length
    if not 2 <= limit <= model.config.max_length:
        raise UsageError(f"--max-length must be in [2, {model.config.max_length}] for "
                         f"{model.path}, got {limit}")
    cli_io.warn_truncated(model.tokenizer, sentences, limit)
    vectors = encode(model, sentences, batch_size=args.batch_size, max_length=limit,
                     normalize=args.normalize, dtype=getattr(jnp, args.dtype))
    if not distributed.is_main_process():
        return 0
    # Exactly this name (np.save on a name would append '.npy'), whole or not at all.
    with store.open_atomic(output, "wb", overwrite=args.overwrite, what="--output") as f:
        np.save(f, vectors)
    print(f"wrote {vectors.shape[0]} x {vectors.shape[1]} vectors to {output}", file=sys.stderr)
    return 0
