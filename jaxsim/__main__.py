"""Command line: `python -m jaxsim encode ...` and `python -m jaxsim export ...`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxsim.search.cli import index_main, search_main


class InputFileError(ValueError):
    """An input file that cannot be used; the message names the file (and line)."""


def read_sentences(path: Path) -> list[str]:
    """One sentence per line (UTF-8). Empty lines are kept as empty sentences."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputFileError(f"{path}: cannot read input file: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise InputFileError(f"{path}:{line}: not valid UTF-8 (byte {e.start})") from None
    lines = text.splitlines()
    if not lines:
        raise InputFileError(f"{path}: input file is empty (expected one sentence per line)")
    return lines


def encode_main(argv) -> int:
    from jaxsim.models.pooling import POOLERS

    parser = argparse.ArgumentParser(prog="python -m jaxsim encode",
                                     description="Encode sentences (one per line) to a .npy matrix.")
    parser.add_argument("--model", default=None,
                        help="HF folder, hub id or train workdir (default: bundled all-MiniLM-L6-v2)")
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--pooler", choices=POOLERS, default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--normalize", action="store_true")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)

    sentences = read_sentences(args.input)
    import numpy as np
    import jax.numpy as jnp
    import jaxsim

    model = jaxsim.load_pretrained(args.model or jaxsim.bundled_model_path())
    vectors = jaxsim.encode(model, sentences, pooler=args.pooler, batch_size=args.batch_size,
                            max_length=args.max_length, normalize=args.normalize,
                            dtype=getattr(jnp, args.dtype))
    np.save(args.output, vectors)
    print(f"wrote {vectors.shape[0]} x {vectors.shape[1]} vectors to {args.output}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"encode": encode_main, "index": index_main, "search": search_main}
    import importlib.util
    if importlib.util.find_spec("jaxsim.export") is not None:
        from jaxsim import export
        commands["export"] = export.main
    if not argv or argv[0] not in commands:
        print(f"usage: python -m jaxsim {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    from jaxsim.errors import USER_ERRORS
    from jaxsim.runtime import enable_compilation_cache
    enable_compilation_cache()
    try:
        return commands[argv[0]](argv[1:]) or 0
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
